"""Which request makes engine steps fail, when the failure does not say.

A step that raises is void: no request advanced and no token was kept (the runner changes a
request's state only once its step succeeded), so the step can be run again. When the
executor names the requests at fault (`RequestFailedError`) the core fails those alone. When
it does not, this triage searches by bisection. The failed step's requests become the
suspects and only the older half of them runs (every other request is held out of steps: it
keeps its blocks and loses nothing, it only waits a few steps). A step that fails narrows the
suspects to the ones that ran; a step that succeeds clears them; the next test is the older
half of the suspects left. A suspect that fails alone is the culprit: the core fails it and
everyone runs again. Newer requests are held first because a request that came just before
the failures began is the likely cause.

A failure that no request causes alone (one that needs a large batch, say) cannot be found
this way, so a request that has been in more failed steps than a bisection of the largest
batch needs is failed as well: the engine ends up failing the requests of the failing steps,
and never hangs on them.
"""

from __future__ import annotations

import math


class StepFailureTriage:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_failures = 2 * math.ceil(math.log2(max(max_num_seqs, 2))) + 2
        self._failures: dict[str, int] = {}  # failed steps each live request was in
        self._suspects: list[str] = []  # oldest first; empty when no search runs
        self._tested: list[str] = []  # the only requests allowed to run while a search runs

    @property
    def is_active(self) -> bool:
        """Whether any request is suspected (else nothing needs telling)."""
        return bool(self._failures or self._suspects)

    @property
    def tested(self) -> set[str] | None:
        """The requests that may run now; None: all of them."""
        return set(self._tested) if self._suspects else None

    def on_failure(self, step: list[str]) -> list[str]:
        """A step of these requests (oldest first) failed and no request was named: the
        requests to fail now."""
        for request_id in step:
            self._failures[request_id] = self._failures.get(request_id, 0) + 1
        worn_out = [i for i in step if self._failures[i] > self.max_failures]
        if worn_out or len(step) == 1:
            self._suspects, self._tested = [], []
            return worn_out or list(step)
        self._suspects = list(step)
        self._tested = self._suspects[: len(step) // 2]
        return []

    def on_success(self, step: list[str]) -> None:
        """A step of these requests ran."""
        cleared = set(step) & set(self._tested)
        if cleared:
            self._drop(cleared)

    def forget(self, request_ids: list[str]) -> None:
        """These requests finished (or were failed): they are suspected of nothing now."""
        for request_id in request_ids:
            self._failures.pop(request_id, None)
        self._drop(set(request_ids))

    def _drop(self, gone: set[str]) -> None:
        """No longer suspects; when none of the tested is left, test the older half of the
        rest (the last one alone), or end the search."""
        self._suspects = [i for i in self._suspects if i not in gone]
        self._tested = [i for i in self._tested if i not in gone]
        if not self._tested:
            self._tested = self._suspects[: max(len(self._suspects) // 2, 1)]
