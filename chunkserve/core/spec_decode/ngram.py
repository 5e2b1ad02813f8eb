"""Prompt lookup (n-gram) drafts: the request's own tokens propose what comes next.

The longest suffix of the request's tokens (between `prompt_lookup_max` and `prompt_lookup_min`
tokens long) that also occurs earlier in its prompt or output proposes the tokens that followed
its most recent earlier occurrence. Copying and editing work (quoting a passage, rewriting
code) repeats long runs of the prompt, which this finds at no model cost; free text mostly
finds nothing, and then there are no drafts at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_model_len: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (prompt + output so far), no more than fit
        under `max_model_len` (the drafts sit at positions len(token_ids).. and are computed).

        [1, 2, 3, 4, 2, 3] with n in [2, 3] and k 4: no earlier [4, 2, 3]; [2, 3] occurred at
        position 1, followed by [4, 2, 3] -> [4, 2, 3]."""
        num_tokens = len(token_ids)
        k = min(self.k, max_model_len - num_tokens)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # every earlier occurrence ends at a position holding the last token (and is followed by
        # a token of its own): extend each such match backwards, up to max_n tokens
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not ends.size:
            return []
        lengths = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            before = ends - back
            alive &= before >= 0
            alive[alive] = tokens[before[alive]] == tokens[num_tokens - 1 - back]
            if not alive.any():
                break
            lengths += alive
        longest = int(lengths.max())
        if longest < self.min_n:
            return []
        start = int(ends[np.flatnonzero(lengths == longest)[-1]]) + 1  # the most recent of the longest
        return tokens[start : start + k].tolist()
