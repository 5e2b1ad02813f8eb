"""The pieces of the non-float32 modes' accuracy contracts (tests/model/test_bf16_accuracy.py,
test_int8_accuracy.py): the prompts, transformers' greedy reference, where two greedy outputs
part, the KL divergence per token, and our logits over given sequences."""

from __future__ import annotations

import torch

from tests.paged_runner import PagedRunner

# 32 prompts of everyday kinds: facts, instructions, code, lists, dialogue, arithmetic, other languages
ACCURACY_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The largest planet in our solar system is",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Q: What is 12 times 7?\nA:",
    "List five fruits that are red:",
    "The French word for 'cat' is",
    "Explain why the sky is blue in one paragraph.",
    "In 1969, the first humans",
    "SELECT name, age FROM users WHERE",
    "A haiku about autumn leaves:",
    "The main difference between a virus and a bacterium is",
    "Dear customer, thank you for your order. Unfortunately,",
    "The Pythagorean theorem states that",
    "Here is a recipe for pancakes. Ingredients:",
    "Machine learning is a field of computer science that",
    "User: Can you recommend a good book?\nAssistant:",
    "The mitochondria is known as",
    "Translate to German: Good morning, how are you?",
    "The steps to change a flat tire are:",
    "Shakespeare wrote many plays, including",
    "for (int i = 0; i < n; i++) {",
    "The speed of light in a vacuum is approximately",
    "An apple a day",
    "The benefits of regular exercise include",
    "Summarize the plot of Romeo and Juliet:",
]


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two outputs differ, or None where they are equal."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def vllm_rule_check(prompts: list[list[int]], reference: list[tuple[list[int], torch.Tensor]],
                    outputs) -> tuple[int, list[tuple[list[int], int]]]:
    """vLLM's rule (`check_logprobs_close`) on our greedy `outputs` (with logprobs=5) against
    transformers' `reference` (hf_greedy): where the two first differ, each side's token must be
    among the other's top-5. Returns how many outputs differ and the (prompt, position) of each
    that breaks the rule."""
    broken, diverged = [], 0
    for prompt, (hf_tokens, hf_logits), output in zip(prompts, reference, outputs):
        ours = output.outputs[0]
        at = first_divergence(ours.token_ids, hf_tokens)
        if at is None:
            continue
        diverged += 1
        our_top5 = {token for token, entry in ours.logprobs[at].items() if entry.rank is not None and entry.rank <= 5}
        hf_top5 = set(hf_logits[at].topk(5).indices.tolist())
        if hf_tokens[at] not in our_top5 or ours.token_ids[at] not in hf_top5:
            broken.append((prompt, at))
    return diverged, broken


def kl_per_token(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(reference || ours) of each row's next-token distribution (logits [rows, vocab]), in nats."""
    log_p, log_q = reference.double().log_softmax(-1), ours.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def teacher_forced_logits(model, sequences: list[list[int]], last: int, cpp_ops) -> torch.Tensor:
    """The logits of the `last` rows of each sequence, every sequence one prefill in one step."""
    runner = PagedRunner(model, model.config, num_blocks=sum(-(-len(s) // 16) for s in sequences) + 1,
                         cpp_ops=cpp_ops)
    for index, sequence in enumerate(sequences):
        runner.add(str(index), sequence)
    rows = runner.step({str(index): len(sequence) for index, sequence in enumerate(sequences)})
    return torch.cat([rows[str(index)][-last:] for index in range(len(sequences))])


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' `new_tokens` greedy tokens of each prompt (EOS does not stop it, as
    ignore_eos) and the float32 logits that chose each: the prompts batched, left-padded."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, logits = [], []
    with torch.inference_mode():
        out = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(new_tokens):
            logits.append(out.logits[:, -1].float())
            tokens.append(logits[-1].argmax(-1))
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            out = hf_model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                           past_key_values=out.past_key_values, use_cache=True)
    tokens, logits = torch.stack(tokens, dim=1), torch.stack(logits, dim=1)
    return [(tokens[i].tolist(), logits[i]) for i in range(len(prompts))]


def teacher_forced_decode_logits(model, prompts: list[list[int]], continuations: list[list[int]], cpp_ops,
                                 group: int = 8) -> torch.Tensor:
    """Our logits for each continuation's tokens, the prompt one prefill and then the continuation
    fed one token per decode step, `group` sequences at a time: the steps a mode that changes only
    few-row steps (the block kernel's) computes differently."""
    sequences = [prompt + continuation[:-1] for prompt, continuation in zip(prompts, continuations)]
    runner = PagedRunner(model, model.config, num_blocks=sum(-(-len(s) // 16) for s in sequences) + 1,
                         cpp_ops=cpp_ops)  # once: set_ops packs the weights and drops the float ones
    for index, sequence in enumerate(sequences):
        runner.add(str(index), sequence)
    rows = []
    for first in range(0, len(prompts), group):
        ids = [str(i) for i in range(first, min(first + group, len(prompts)))]
        per_step = [runner.step({key: len(prompts[int(key)]) for key in ids})]
        per_step += [runner.step({key: 1 for key in ids}) for _ in range(len(continuations[first]) - 1)]
        rows += [torch.cat([step[key][-1:] for step in per_step]) for key in ids]
    return torch.cat(rows)
