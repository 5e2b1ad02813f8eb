"""The grammars of the requests in flight (structured outputs), on the engine core's side.

A request's grammar compiles on a thread of its own (llguidance drops the GIL while it builds
one), so the step loop never waits for it: the scheduler keeps the request out of the steps
until it is ready and everything else keeps stepping. Compiled grammars are cached by their
text (a prototype matcher; each request gets a copy, which is cheap: docs/STRUCTURED_OUTPUTS.md).
At each step the scheduler asks for the token bitmask of every row that samples (a request's
last row and one per draft before it: prompt chunks need none) and advances a request's matcher
only by the tokens the step accepted, so a rejected draft never reaches it.

A bitmask row is `(vocab_size + 31) // 32` int32 words, bit t of word t // 32 set when token
t is allowed (llguidance's layout): the sampler unpacks it over the logits row.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from chunkserve.core.structured.grammar import grammar_text
from chunkserve.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each a few hundred KB at most for large schemas)


class GrammarError(Exception):
    """A grammar that does not compile, or an output that left it."""


class StructuredOutputManager:
    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE, compile_threads: int = 1) -> None:
        """`tokenizer_factory`: the model's Hugging Face tokenizer, loaded on the first compile
        (llguidance reads its vocabulary: about a second, off the step loop). `vocab_size`: the
        model's logits width, which the masks cover."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._tokenizer_factory = tokenizer_factory
        self._ll_tokenizer: Any = None
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="chunkserve-grammar")
        self._lock = threading.Lock()  # the cache and the compile times, shared with the pool
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer loads (a second): not by the step loop
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[str, Future] = {}
        self._matchers: dict[str, Any] = {}
        self._compile_seconds: list[float] = []  # of grammars compiled (not cache hits) since the last take
        self.cache_hits = 0
        self.cache_misses = 0

    def use_tokenizer(self, tokenizer: Any) -> None:
        """A tokenizer already loaded (an engine core in the frontend's process shares the
        frontend's, which from a GGUF file takes seconds to build)."""
        self._tokenizer_factory = lambda: tokenizer

    def prepare(self) -> None:
        """Load the vocabulary into the grammar library now, on the compile thread, so that the
        first constrained request waits for its grammar only (what loading it costs:
        docs/STRUCTURED_OUTPUTS.md)."""
        self._pool.submit(self._tokenizer)

    # ----- requests -------------------------------------------------------------------------

    def add(self, request_id: str, params: StructuredOutputsParams, replay: list[int] = ()) -> None:
        """Start compiling the request's grammar. `replay`: output tokens it already has (an
        imported request), consumed once compiled."""
        self._compiling[request_id] = self._pool.submit(self._matcher_for, grammar_text(params), list(replay))

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._compiling

    def is_ready(self, request_id: str) -> bool:
        """No grammar, or compiled (a failed compile is ready too: `take_failures` reports it)."""
        future = self._compiling.get(request_id)
        if future is None:
            return True
        if not future.done():
            return False
        if future.exception() is None:
            self._matchers[request_id] = future.result()
            del self._compiling[request_id]
        return future.exception() is None

    def take_failures(self) -> dict[str, str]:
        """Requests whose grammar failed to compile -> why; they are forgotten here."""
        failed = {request_id: str(future.exception()) for request_id, future in self._compiling.items()
                  if future.done() and future.exception() is not None}
        for request_id in failed:
            del self._compiling[request_id]
        return failed

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until a grammar being compiled is done, or `timeout_s`: the step loop's idle
        wait while the only runnable requests are compiling."""
        pending = [f for f in self._compiling.values() if not f.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()

    def registry_sizes(self) -> dict[str, int]:
        """Grammars per state, every one keyed by request id (empty once no request is left)."""
        return {"compiling": len(self._compiling), "matchers": len(self._matchers)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- the step ----------------------------------------------------------------------------

    def num_valid_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of the drafts, from the first, the grammar allows: only those are verified."""
        return self._matchers[request_id].validate_tokens(drafts) if drafts else 0

    def bitmask(self, request_id: str, drafts: list[int]) -> np.ndarray:
        """int32 [1 + len(drafts), num_words]: row j allows what may follow the output and the
        first j drafts (which `num_valid_drafts` has checked). The matcher ends as it began."""
        matcher = self._matchers[request_id]
        masks = np.zeros((1 + len(drafts), self.num_words), dtype=np.int32)
        consumed = 0
        for row in range(len(masks)):
            matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks[row].nbytes)
            if row < len(drafts):
                if not matcher.consume_token(drafts[row]):
                    raise GrammarError(f"draft token {drafts[row]} left the grammar: {matcher.get_error()}")
                consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return masks

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        """Advance by the step's accepted tokens; GrammarError if one is outside the grammar."""
        matcher = self._matchers[request_id]
        if not matcher.consume_tokens(token_ids):
            raise GrammarError(f"the output left its grammar: {matcher.get_error()}")

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and allows nothing more (the output is whole)."""
        return self._matchers[request_id].is_stopped()

    def take_compile_seconds(self) -> list[float]:
        with self._lock:
            taken, self._compile_seconds = self._compile_seconds, []
        return taken

    # ----- the compile thread --------------------------------------------------------------------

    def _matcher_for(self, grammar: str, replay: list[int]) -> Any:
        import llguidance

        tokenizer = self._tokenizer()
        with self._lock:
            prototype = self._cache.get(grammar)
            if prototype is not None:
                self._cache.move_to_end(grammar)
                self.cache_hits += 1
        if prototype is None:
            start = time.perf_counter()
            prototype = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if prototype.is_error():
                raise GrammarError(f"the grammar does not compile: {prototype.get_error()}")
            # the first mask builds the lexer's start states: here rather than in the first step
            scratch = np.zeros(self.num_words, dtype=np.int32)
            prototype.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            with self._lock:
                self._compile_seconds.append(time.perf_counter() - start)
                self.cache_misses += 1
                self._cache[grammar] = prototype
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        matcher = prototype.deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise GrammarError(f"the request's output so far is outside its grammar: {matcher.get_error()}")
        return matcher

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer_factory(), n_vocab=self.vocab_size)
            return self._ll_tokenizer
