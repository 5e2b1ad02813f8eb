"""Which request makes engine steps fail, when the failure does not say.

A step that raises is void: no request advanced and no token was kept (the runner changes a
request's state only once its step succeeded), so the step can be run again. When the
executor names the requests at fault (`RequestFailedError`) the core fails those alone. When
it does not, this triage searches by bisection. The failed step's requests become the
suspects and only the older half of them runs; every other request waits (it keeps its place,
though a tested request short of KV preempts a waiting one first). A step that fails narrows
the suspects to the ones that ran; a step that succeeds clears them; the next test is the
older half of the suspects left. A suspect that fails alone is the culprit: the core fails it
and everyone runs again. Newer requests are held first because a request that came just before
the failures began is the likely cause.

Every search ends: each step that runs a tested request shrinks the suspects, and the core
ends a search whose tested requests cannot be scheduled. A failure that no request causes
alone (one that needs a large batch, say) is never pinned on one: its searches end without a
culprit, the tested requests having made progress alone meanwhile.
"""

from __future__ import annotations


class StepFailureTriage:
    def __init__(self) -> None:
        self._suspects: list[str] = []  # oldest first; empty when no search runs
        self._tested: list[str] = []  # the only requests allowed to run while a search runs

    @property
    def is_active(self) -> bool:
        return bool(self._suspects)

    @property
    def tested(self) -> set[str] | None:
        """The requests that may run now; None: all of them."""
        return set(self._tested) if self._suspects else None

    def on_failure(self, step: list[str]) -> list[str]:
        """A step of these requests (oldest first) failed and no request was named: the
        requests to fail now (the culprit, once it failed alone)."""
        if len(step) == 1:
            self.end()
            return list(step)
        self._suspects = list(step)
        self._tested = self._suspects[: len(step) // 2]
        return []

    def on_success(self, step: list[str]) -> None:
        """A step of these requests ran."""
        cleared = set(step) & set(self._tested)
        if cleared:
            self.forget(cleared)

    def forget(self, request_ids: set[str] | list[str]) -> None:
        """No longer suspects (cleared, finished or failed); when none of the tested is left,
        test the older half of the rest (the last one alone), or end the search."""
        gone = set(request_ids)
        self._suspects = [i for i in self._suspects if i not in gone]
        self._tested = [i for i in self._tested if i not in gone]
        if not self._tested:
            self._tested = self._suspects[: max(len(self._suspects) // 2, 1)]

    def end(self) -> None:
        self._suspects, self._tested = [], []
