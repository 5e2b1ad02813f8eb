"""Speculative decoding end to end on the default SmolLM2 model (n-gram drafts, policy
"always" so every draft found is verified): greedy tokens and logprobs equal an engine
without speculation under every budget and beside a long prefill; rejected drafts never
reach the prefix cache; stops, max_tokens, preemption and aborts inside draft runs; seeded
sampling; tensor parallelism 2 with drafts. A draft model's first proposals are checked on the
tiny model drafting for itself (every draft accepted, whatever its weights). The behaviour checks
stay on SmolLM2: the tiny random model never repeats its context, so n-gram drafts are never
accepted there, even with single-token lookups. The draft-model method over HTTP (and its
/metrics) is in tests/entrypoints/server/test_speculative_server.py."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.core.kv.kv_cache_manager import ROOT_HASH, hash_block
from tests.engine.support import assert_pool_free
from tests.engine.tiny_llm_support import TINY, build_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "policy": "always"}
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
TOL = 1e-4
BLOCK_SIZE = 16  # the engine's default

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
           "The five boxing wizards jump quickly, and a wizard's job is to vex chumps quickly in fog.")
STORY = ("The lighthouse keeper climbed the stairs each evening, counting the steps and listening to the gulls "
         "over the grey water while the ships went by. At the top he lit the lamp, wiped the glass, and wrote "
         "the weather in his book before the night came down over the harbour.")
PYTHON = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
JAVASCRIPT = '''function countWords(text) {
  const counts = {};
  for (const word of text.toLowerCase().split(/\\s+/)) {
    if (word.length === 0) continue;
    counts[word] = (counts[word] || 0) + 1;
  }
  return counts;
}
'''
COPY_TASKS = [  # copying and editing: long runs of the prompt come back, n-gram drafts find them
    "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "Rewrite this Python code with type hints and docstrings, keeping the logic the same:\n\n" + PYTHON,
    "Copy this story, then continue it with one more sentence:\n\n" + STORY,
    "Rewrite this JavaScript function in Python:\n\n" + JAVASCRIPT,
    "Fix the spelling mistakes and repeat the text: Teh lighthouse keper climbed teh stairs each evening, "
    "counting the steps and listening to the gulls over the grey water.",
    "Repeat this list back to me, one item per line: apples, bananas, cherries, dates, elderberries, figs, "
    "grapes, honeydew, kiwis, lemons, mangoes, nectarines.",
]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence why the sky is blue.", "List three prime numbers.",
             "Give me a simple recipe for pancakes.", "What is gravity?", "Describe a cat in two sentences.",
             "Why do we need to sleep?"]
NUM_COPY = len(COPY_TASKS)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def all_prompts(llm: LLM) -> list[list[int]]:
    """16 prompts: the copy tasks first, then ordinary chat questions, then two raw texts that
    repeat (counting, code followed by 'the same code again')."""
    tokenizer = llm.get_tokenizer()
    return ([chat(llm, t) for t in COPY_TASKS + QUESTIONS]
            + [tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
               tokenizer.encode(PYTHON + "\n\n# The same code again:\n")])


def long_prompt(llm: LLM) -> list[int]:
    """About 1500 tokens."""
    return chat(llm, "Summarise this text:\n\n" + (STORY + " " + PASSAGE + " ") * 12)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ----- watching the drafts ---------------------------------------------------------------------


@dataclass
class Run:
    num_output_tokens: int  # the request's output tokens before the step
    drafts: list[int]  # the drafts the step verified
    tokens: list[int]  # what the step produced: its accepted drafts, then the target's own token

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class DraftLog:
    """Every verified draft run, by the request's prompt (read off the scheduler's
    update_from_output, before it applies the run)."""

    def __init__(self) -> None:
        self.runs: dict[tuple[int, ...], list[Run]] = {}
        self.preempted_with_drafts = 0  # preemptions of requests whose next drafts were waiting

    def of(self, prompt: list[int]) -> list[Run]:
        return self.runs.get(tuple(prompt), [])

    def all(self) -> list[Run]:
        return [run for runs in self.runs.values() for run in runs]


@contextmanager
def watching(llm: LLM):
    scheduler = llm.engine.engine_core.scheduler
    log = DraftLog()

    def update_from_output(output, runner_output):
        for scheduled in output.scheduled:
            request = scheduler.requests.get(scheduled.request_id)
            tokens = runner_output.sampled_token_ids.get(scheduled.request_id)
            if request is not None and scheduled.draft_token_ids and tokens:
                log.runs.setdefault(tuple(request.prompt_token_ids), []).append(
                    Run(len(request.output_token_ids), list(scheduled.draft_token_ids), list(tokens)))
        return original_update(output, runner_output)

    def preempt(request, step):
        log.preempted_with_drafts += bool(request.spec_token_ids)
        return original_preempt(request, step)

    original_update, original_preempt = scheduler.update_from_output, scheduler._preempt
    scheduler.update_from_output, scheduler._preempt = update_from_output, preempt
    try:
        yield log
    finally:
        del scheduler.update_from_output, scheduler._preempt  # back to the class's methods


def drafts_of(records) -> tuple[int, int]:
    return sum(r.num_draft_tokens for r in records), sum(r.num_accepted_tokens for r in records)


# ----- engines and references ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    """No speculation: the reference."""
    return LLM(dtype="float32", max_num_batched_tokens=512, kv_cache_memory_gb=0.25, max_num_seqs=32)


@pytest.fixture(scope="module")
def spec():
    return LLM(dtype="float32",
               max_num_batched_tokens=512, kv_cache_memory_gb=0.25, max_num_seqs=32, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def spec64():
    return LLM(dtype="float32",
               max_num_batched_tokens=64, kv_cache_memory_gb=0.25, max_num_seqs=32, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def prompts(plain):
    return all_prompts(plain)


@pytest.fixture(scope="module")
def expected(plain, prompts):
    """The greedy tokens without speculation, once at budget 512 (tests/entrypoints/test_llm.py
    checks that budgets do not change greedy outputs)."""
    return token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))


# ----- 1. greedy outputs -----------------------------------------------------------------------


# budgets 64 and 16 (drafts beside prompt chunks) in every tier, 512 in the long tier
@pytest.mark.parametrize("budget", [pytest.param(512, marks=pytest.mark.slow), 64, 16])
def test_greedy_outputs_equal_no_speculation(request, prompts, expected, budget):
    if budget == 512:
        llm = request.getfixturevalue("spec")
    elif budget == 64:
        llm = request.getfixturevalue("spec64")
    else:  # blocks of 4 tokens: prompt chunks (whole blocks) fit beside the decodes and their drafts
        llm = LLM(dtype="float32", max_num_batched_tokens=16, max_num_seqs=8, block_size=4, kv_cache_memory_gb=0.25,
                  speculative_config=NGRAM)
    before = len(llm.get_step_records())
    with watching(llm) as log:
        got = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    for index, (tokens, reference) in enumerate(zip(got, expected)):
        assert tokens == reference, f"prompt {index}: first difference at token " \
            f"{next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)}"
    records = llm.get_step_records()[before:]
    drafted, accepted = drafts_of(records)
    assert drafted == sum(len(run.drafts) for run in log.all()) > 0
    assert accepted == sum(run.num_accepted for run in log.all())
    assert 0 < accepted < drafted, "expected both accepted and rejected drafts"
    copy_accepted = [sum(run.num_accepted for run in log.of(p)) for p in prompts[:NUM_COPY]]
    assert sum(copy_accepted) >= 64, copy_accepted
    assert max(len(run.drafts) for run in log.all()) == NGRAM["num_speculative_tokens"]
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= budget for r in records)
    assert any(r.forward_mode.value == "MIXED" and r.num_draft_tokens > 0 for r in records)
    stats = llm.engine.engine_core.get_stats().spec_decode
    assert stats.num_draft_tokens >= drafted and stats.mean_acceptance_length > 1.0
    assert_pool_free(llm)


def test_a_long_prefill_shares_steps_with_speculating_decodes(plain, spec64, prompts, expected):
    """The copy tasks decode with drafts while a ~1500-token prompt is prefilled in 64-token
    steps beside them."""
    long = long_prompt(plain)
    assert 1300 <= len(long) <= 1700
    short = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = token_ids(plain.generate(long, short, use_tqdm=False))[0]
    before = len(spec64.get_step_records())
    outputs = spec64.generate(prompts[:NUM_COPY] + [long], [GREEDY] * NUM_COPY + [short], use_tqdm=False)
    assert token_ids(outputs) == expected[:NUM_COPY] + [reference]
    records = spec64.get_step_records()[before:]
    mixed = [r for r in records if r.forward_mode.value == "MIXED" and r.num_draft_tokens > 0]
    assert len(mixed) >= 5, "the long prompt's chunks never shared a step with verified drafts"
    assert sum(r.num_prefill_tokens for r in mixed) >= 200
    assert any(r.num_accepted_tokens > 0 for r in mixed)
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 64 for r in records)
    assert_pool_free(spec64)


@pytest.mark.slow  # the auto policy profiles the step time at start-up (~15 s here)
def test_auto_policy_outputs_equal_no_speculation(prompts, expected):
    llm = LLM(dtype="float32", max_num_batched_tokens=512, kv_cache_memory_gb=0.25, max_num_seqs=32,
              speculative_config=dict(NGRAM, policy="auto"))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert drafts_of(llm.get_step_records())[1] > 0
    assert_pool_free(llm)


# ----- 3. rollback -----------------------------------------------------------------------------


def kv_pool(llm: LLM) -> torch.Tensor:
    return llm.engine.engine_core.executor.worker.runner.kv_pool


def cached_blocks(llm: LLM) -> dict[bytes, int]:
    return dict(llm.engine.engine_core.scheduler.kv.pool.cached_blocks())


def block_kv(llm: LLM, block_id: int) -> torch.Tensor:
    pool = kv_pool(llm)
    layers, _, slots, heads, dim = pool.shape
    return pool.view(layers, 2, slots // BLOCK_SIZE, BLOCK_SIZE, heads, dim)[:, :, block_id]


def chain(tokens: list[int]) -> list[bytes]:
    """The prefix cache's hashes of the full blocks of `tokens`."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block(parent, tokens[start : start + BLOCK_SIZE])
        hashes.append(parent)
    return hashes


def test_rejected_drafts_never_reach_the_prefix_cache(plain, spec, prompts, expected):
    """A run with rejections, then a request that continues its prompt + output: the same
    cached prefix, tokens and logprobs as without speculation, and every cached block holds
    the KV the reference engine computed for the same tokens."""
    for llm in (plain, spec):
        assert llm.reset_prefix_cache()
    first = prompts[1]  # the code rewrite: drafts accepted and rejected
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with watching(spec) as log:
        output = token_ids(spec.generate(first, params, use_tqdm=False))[0]
    assert output == token_ids(plain.generate(first, params, use_tqdm=False))[0] == expected[1]
    runs = log.of(first)
    assert sum(run.num_accepted for run in runs) > 0
    assert any(run.num_accepted < len(run.drafts) for run in runs), "no draft was rejected"

    second = first + output  # its prefix: the first request's prompt and output
    follow = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    got = spec.generate(second, follow, use_tqdm=False)[0]
    want = plain.generate(second, follow, use_tqdm=False)[0]
    assert got.num_cached_tokens == want.num_cached_tokens == (len(second) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert_same_logprobs(got, want)

    spec_blocks, plain_blocks = cached_blocks(spec), cached_blocks(plain)
    assert set(spec_blocks) == set(plain_blocks)
    covered = chain(second + got.outputs[0].token_ids[:-1])  # every computed full block of the second request
    assert set(covered) <= set(spec_blocks) and len(covered) == len(spec_blocks)
    for block_hash in covered:
        torch.testing.assert_close(block_kv(spec, spec_blocks[block_hash]), block_kv(plain, plain_blocks[block_hash]),
                                   atol=TOL, rtol=TOL, msg=lambda m: f"block {covered.index(block_hash)}: {m}")
    assert_pool_free(spec)


# ----- 4. stops, max_tokens, preemption, aborts --------------------------------------------------

EOS_TASKS = ["Repeat this sentence exactly: I love reading books on rainy days.",
             "Repeat after me: Practice makes perfect.",
             "Copy this line: The meeting is at noon on Friday.",
             "Repeat exactly: The cat sat on the mat."]


def inside_a_run(runs: list[Run], index: int) -> bool:
    """Whether output token `index` was an accepted draft with more of its run after it."""
    return any(run.num_output_tokens <= index < run.num_output_tokens + len(run.tokens) - 1 for run in runs)


def test_eos_inside_an_accepted_run_ends_the_output_there(plain, spec):
    prompts = [chat(plain, t) for t in EOS_TASKS]
    params = SamplingParams(max_tokens=100, temperature=0.0)
    expected = plain.generate(prompts, params, use_tqdm=False)
    with watching(spec) as log:
        got = spec.generate(prompts, params, use_tqdm=False)
    eos = plain.get_tokenizer().eos_token_id
    covered = 0
    for prompt, a, b in zip(prompts, got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"
        tokens = a.outputs[0].token_ids
        assert tokens[-1] == eos and eos not in tokens[:-1]
        covered += inside_a_run(log.of(prompt), len(tokens) - 1)
    assert covered, "no EOS was accepted as a draft with more of its run after it"
    assert_pool_free(spec)


def test_stop_string_inside_an_accepted_run(plain, spec):
    """Stop strings from the middle of a passage the model copies: drafts cover them."""
    prompt = chat(plain, "Repeat exactly:\n\n" + PASSAGE)
    unstopped = plain.generate(prompt, SamplingParams(max_tokens=100, temperature=0.0), use_tqdm=False)[0]
    stops = ["dozen liquor", "judge my", "wizards jump"]
    assert all(stop in unstopped.outputs[0].text for stop in stops), unstopped.outputs[0].text
    found = 0
    for stop in stops:
        params = SamplingParams(max_tokens=100, temperature=0.0, stop=[stop])
        reference = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        with watching(spec) as log:
            output = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (reference.finish_reason, reference.stop_reason) == ("stop", stop)
        assert (output.finish_reason, output.stop_reason) == ("stop", stop)
        assert output.text == reference.text == unstopped.outputs[0].text[: unstopped.outputs[0].text.index(stop)]
        assert output.token_ids == reference.token_ids
        found += inside_a_run(log.of(prompt), len(output.token_ids) - 1)
    assert found, "no stop string was completed inside an accepted run"
    assert not spec.engine.engine_core.scheduler.requests
    assert_pool_free(spec)


def test_max_tokens_reached_inside_a_run(spec, prompts, expected):
    limits = [5, 7, 10, 13, 22, 31]
    copies = prompts[:NUM_COPY]
    with watching(spec) as log:
        outputs = spec.generate(copies, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                         for n in limits], use_tqdm=False)
    for output, reference, limit, prompt in zip(outputs, expected, limits, copies):
        assert output.outputs[0].token_ids == reference[:limit]
        assert output.outputs[0].finish_reason == "length"
        assert all(run.num_output_tokens + len(run.tokens) <= limit for run in log.of(prompt)), \
            "drafts past max_tokens were verified"
    # the last run of some request ended exactly at its limit with drafts accepted
    assert any(run.num_output_tokens + len(run.tokens) == limit and run.num_accepted > 0
               for prompt, limit in zip(copies, limits) for run in log.of(prompt))
    assert_pool_free(spec)


def test_preemption_with_drafts_pending_keeps_outputs(prompts, expected):
    llm = LLM(dtype="float32",
              num_kv_blocks=20, block_size=BLOCK_SIZE, max_num_batched_tokens=64, speculative_config=NGRAM)
    chosen = prompts[:5]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with watching(llm) as log:
        got = token_ids(llm.generate(chosen, params, use_tqdm=False))
    assert got == [tokens[:48] for tokens in expected[:5]]
    records = llm.get_step_records()
    assert sum(r.num_preemptions for r in records) > 0, "the pool was meant to preempt"
    assert log.preempted_with_drafts > 0, "no request was preempted with drafts waiting"
    assert drafts_of(records)[1] > 0
    assert_pool_free(llm)


def test_abort_of_a_speculating_request_frees_everything(spec, prompts, expected):
    engine, scheduler = spec.engine, spec.engine.engine_core.scheduler
    target = prompts[0]
    engine.add_request("spec-abort", target, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    engine.add_request("spec-other", prompts[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    done = {}
    with watching(spec) as log:
        for _ in range(60):  # until the request has verified drafts and holds more for its next step
            done.update({o.request_id: o for o in engine.step() if o.finished})
            core = next(r for r in scheduler.requests.values() if r.prompt_token_ids == target)
            if log.of(target) and core.spec_token_ids:
                break
        else:
            pytest.fail("the request never got drafts")
        aborted = engine.abort_request("spec-abort")
        assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["spec-other"].outputs[0].token_ids == expected[2][:40]
    assert "spec-abort" not in done
    assert not scheduler.requests
    assert_pool_free(spec)


# ----- 5. logprobs -----------------------------------------------------------------------------


def assert_same_logprobs(got, want) -> None:
    a, b = got.outputs[0], want.outputs[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for index, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):  # vLLM's dicts: the sampled token, the top k
        assert list(x) == list(y) and list(x)[0] == a.token_ids[index], f"token {index}"
        assert [e.logprob for e in x.values()] == pytest.approx([e.logprob for e in y.values()], abs=TOL), \
            f"token {index}"


def test_logprobs_of_accepted_tokens_equal_no_speculation(plain, spec, prompts):
    chosen = prompts[:NUM_COPY] + prompts[NUM_COPY : NUM_COPY + 1]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    want = plain.generate(chosen, params, use_tqdm=False)
    with watching(spec) as log:
        got = spec.generate(chosen, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert len(a.outputs[0].logprobs[0]) == 5  # the top 5, the greedy token among them
        assert_same_logprobs(a, b)
    accepted = [index for prompt in chosen for run in log.of(prompt)
                for index in range(run.num_output_tokens, run.num_output_tokens + run.num_accepted)]
    assert len(accepted) >= 40, "few of the compared tokens were accepted drafts"
    assert_pool_free(spec)


# ----- 6. seeded sampling ----------------------------------------------------------------------


def test_seeded_sampling_with_drafts_is_reproducible(spec, prompts):
    copies = prompts[:3]
    seeded = [SamplingParams(max_tokens=32, temperature=0.8, seed=1000 + i, ignore_eos=True) for i in range(3)]
    with watching(spec) as log:
        first = token_ids(spec.generate(copies, seeded, use_tqdm=False))
    runs = log.all()
    assert sum(run.num_accepted for run in runs) > 0, "no draft was accepted while sampling"
    assert any(run.num_accepted < len(run.drafts) for run in runs), "no draft was rejected while sampling"
    assert token_ids(spec.generate(copies, seeded, use_tqdm=False)) == first
    alone = token_ids(spec.generate(copies[0], seeded[0], use_tqdm=False))[0]
    assert alone == first[0]
    other = SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    assert token_ids(spec.generate(copies[0], other, use_tqdm=False))[0] != first[0]
    assert_pool_free(spec)


# ----- the draft model's proposals ---------------------------------------------------------------


def test_a_draft_model_proposes_from_the_step_that_finishes_the_prompt(tiny_gguf):
    """The tiny model drafting for itself: its greedy drafts are its own tokens, all accepted."""
    plain = build_llm(TINY, tiny_gguf, max_num_batched_tokens=512)
    llm = build_llm(TINY, tiny_gguf, max_num_batched_tokens=512, speculative_config={
        "method": "draft_model", "model": tiny_gguf, "num_speculative_tokens": 3, "policy": "always"})
    prompt = chat(plain, QUESTIONS[0])
    with watching(llm) as log:
        output = token_ids(llm.generate(prompt, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                                        use_tqdm=False))[0]
    assert output == token_ids(plain.generate(prompt, SamplingParams(max_tokens=9, temperature=0.0,
                                                                     ignore_eos=True), use_tqdm=False))[0]
    runs = log.of(prompt)  # the prompt's step samples a token and proposes k drafts: the first decode verifies them
    assert [(run.num_output_tokens, len(run.drafts), run.num_accepted) for run in runs] == [(1, 3, 3), (5, 3, 3)]
    assert_pool_free(llm)


# ----- 7. tensor parallelism -------------------------------------------------------------------


def test_tp2_with_ngram_drafts_equals_tp1(tmp_path, default_tokenizer):
    from tests.executor.support import assert_same, prompts_of, tiny_llama

    model = tiny_llama(tmp_path, default_tokenizer, 2)
    prompts = prompts_of(default_tokenizer)
    # a random model repeats little: single-token lookups find drafts (most of them rejected)
    ngram = dict(NGRAM, prompt_lookup_min=1, prompt_lookup_max=3)
    common = dict(max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, ignore_eos=True)
    expected = LLM(model, dtype="float32", **common).generate(prompts, params, use_tqdm=False)
    tp = LLM(model, dtype="float32", tensor_parallel_size=2, speculative_config=ngram, **common)
    try:
        got = tp.generate(prompts, params, use_tqdm=False)
        assert_same(got, expected, TOL)
        drafted, accepted = drafts_of(tp.get_step_records())
        assert drafted >= 10 and 0 < accepted < drafted
        assert_pool_free(tp)
    finally:
        tp.engine.shutdown()
