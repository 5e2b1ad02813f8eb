"""The encoder cache's bookkeeping (vLLM V1's EncoderCacheManager): which images' encoder outputs
the worker holds, who needs them, and when they may go.

The vision encoder runs on a whole image at once, but a prompt chunk may take only a slice of the
image's rows, so the output waits in the worker's encoder cache until every row is in the KV
cache. Outputs are shared by content (`MultiModalFeature.identifier`): a request that finds its
image's output cached takes a reference instead of encoding it again. An output no request
references stays, in a least-recently-freed order, until its room is needed (a repeated image
is then still encoded once); evicting it is the only way an output leaves, and the identifiers
evicted since the last step tell the worker what to drop (`SchedulerOutput.free_encoder_ids`).

Capacity counts encoder output rows (`MultiModalFeature.num_embeds`). The scheduler asks
`can_allocate` while it plans a step and `allocate` once the step takes the item; an output is
in the cache from the step that encodes it on, since the worker encodes before the forward.
"""

from __future__ import annotations

from collections import OrderedDict

from chunkserve.core.multimodal import MultiModalFeature


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_free_slots = capacity  # rows held by no output
        self._referenced: dict[str, set[str]] = {}  # identifier -> ids of the requests that need its output
        self._freeable: OrderedDict[str, int] = OrderedDict()  # identifier -> rows; referenced by none, oldest first
        self._sizes: dict[str, int] = {}  # identifier -> rows, of every output held
        self._evicted: list[str] = []  # since the last step

    @property
    def num_freeable_slots(self) -> int:
        """Rows free now or once unreferenced outputs are evicted."""
        return self.num_free_slots + sum(self._freeable.values())

    def is_cached(self, identifier: str) -> bool:
        return identifier in self._sizes

    def holds(self, identifier: str, request_id: str) -> bool:
        """Whether the request references the output already."""
        return request_id in self._referenced.get(identifier, ())

    def freeable_rows(self, identifier: str) -> int:
        """The rows of an unreferenced output (0 if it is referenced or not held)."""
        return self._freeable.get(identifier, 0)

    def check_and_update_cache(self, request_id: str, feature: MultiModalFeature) -> bool:
        """Whether the item's output is held; if so, the request now references it."""
        identifier = feature.identifier
        if identifier not in self._sizes:
            return False
        self._freeable.pop(identifier, None)
        self._referenced.setdefault(identifier, set()).add(request_id)
        return True

    def can_allocate(self, num_embeds: int, budget_left: int, num_embeds_planned: int = 0,
                     num_pinned: int = 0) -> bool:
        """Whether an output of `num_embeds` rows fits the step's encoder budget left and the cache,
        beside `num_embeds_planned` rows planned already and unreferenced outputs of `num_pinned`
        rows that the plan takes references to (those cannot be evicted for it)."""
        if num_embeds > budget_left:
            return False
        return num_embeds + num_embeds_planned <= self.num_freeable_slots - num_pinned

    def allocate(self, request_id: str, feature: MultiModalFeature) -> None:
        """Hold room for the item's output (encoded in this step), referenced by the request,
        evicting unreferenced outputs, least recently freed first, as needed."""
        num_embeds = feature.num_embeds
        assert feature.identifier not in self._sizes, f"{feature.identifier} is held already"
        assert num_embeds <= self.num_freeable_slots, "allocate without can_allocate"
        while self.num_free_slots < num_embeds:
            identifier, rows = self._freeable.popitem(last=False)
            del self._sizes[identifier]
            self._referenced.pop(identifier, None)
            self._evicted.append(identifier)
            self.num_free_slots += rows
        self.num_free_slots -= num_embeds
        self._sizes[feature.identifier] = num_embeds
        self._referenced[feature.identifier] = {request_id}

    def free_encoder_input(self, request_id: str, identifier: str) -> None:
        """The request no longer needs the output; unreferenced, it becomes evictable."""
        holders = self._referenced.get(identifier)
        if not holders or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            del self._referenced[identifier]
            self._freeable[identifier] = self._sizes[identifier]

    def free(self, request_id: str, features: list[MultiModalFeature]) -> None:
        """Drop every reference of the request (finished, aborted or preempted)."""
        for feature in features:
            self.free_encoder_input(request_id, feature.identifier)

    def discard(self, identifier: str) -> None:
        """Forget an output the worker may not have (its step failed): whoever needs it encodes it again."""
        rows = self._sizes.pop(identifier, None)
        if rows is None:
            return
        self._referenced.pop(identifier, None)
        self._freeable.pop(identifier, None)
        self.num_free_slots += rows
        self._evicted.append(identifier)

    def evicted_again(self, identifiers: list[str]) -> None:
        """Tell the worker again (with the next step) to drop outputs evicted earlier: the step
        that told it failed."""
        self._evicted.extend(identifiers)

    def take_evicted(self) -> list[str]:
        """The outputs evicted since the last call: the worker drops them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def registry_sizes(self) -> dict[str, int]:
        """References, per (output, request): none once no request is unfinished."""
        return {"references": sum(len(holders) for holders in self._referenced.values())}
