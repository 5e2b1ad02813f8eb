"""Multimodal cost: the vision encoder's seconds per image, and what image prompts do to the
decode streams they arrive beside (issue 40).

The model is a random-weight Idefics3 with SmolVLM-256M's shapes, built offline by this script
and cached under `--model-dir`: the text decoder has SmolLM2-135M's shape (hidden 576,
intermediate 1536, 30 layers, 9 heads, 3 KV heads, rope theta 100000) and the default model's
tokenizer with Idefics3's image tokens added; the vision tower is SigLIP-base/16 at 512 x 512
(hidden 768, 12 layers, 12 heads, intermediate 3072) and the pixel shuffle's scale factor 4
makes 64 image tokens per image (no image splitting). Everything runs on the CPU in this process.

What is measured
----------------
* Encoder cost per image: `--images` distinct random 512 x 512 images, one at a time through
  `LLM.chat` (image_url data URLs, max_tokens 1); the median of the step records' `encoder_s`
  per encoded image, at dtype float32 and at the default dtype (`auto`, where it differs). Next
  to it, the decoder's chunk step time: the median `duration_s` of the EXTEND steps of text
  prompts of 64, 256 and 512 tokens (one prompt at a time, a 512-token budget).
* Decode TBT while image prompts arrive: 8 text streams decode (64-token prompts, 128 output
  tokens, EOS ignored); after 10 engine steps an image prompt (one 512 x 512 image and a short
  text, max_tokens 4) arrives every 8 steps, 4 in all. Reported: the streams' inter-token gaps
  (their `metrics.token_times`) p50 / p99 / max and the image prompts' median TTFT, for
  (a) chunked prefill at a 512-token budget, (b) the same with --disable-chunked-mm-input,
  (c) chunked prefill off, and (d) the baseline: (a) with text prompts of the image prompts'
  token count arriving instead (the encoder's share is (a) - (d)). The configurations' order
  alternates across `--rounds`; each number is the median over the rounds. These run at the
  default dtype (bfloat16 where the CPU computes it natively, else float32).
The machine line names the CPU (lscpu) and torch's thread count (its default unless
OMP_NUM_THREADS says otherwise). `--smoke` builds tiny shapes (64-pixel images, 16 image tokens,
a 2-layer decoder) and runs 2 streams, 2 arrivals and one round: its numbers mean nothing.

Run it with

    .venv/bin/python -m benchmarks.engine.multimodal --json multimodal.json
    .venv/bin/python -m benchmarks.engine.multimodal --smoke   # seconds, tiny shapes: does it run?

(a full run takes about 10 minutes on a 2-core machine; the first run also builds the model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from benchmarks.support import add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, RequestOutput, SamplingParams
from chunkserve.bench.host import machine
from chunkserve.config.cpu import auto_dtype
from chunkserve.core.messages import ForwardMode
from chunkserve.entrypoints.llm import engine_prompt

TOKEN_ID_RANGE = (100, 40000)
CHUNK_BUDGET = 512
IMAGE_TEXT = " Describe this image in one word."
# Renders OpenAI-style content lists as SmolVLM's template does: each image part becomes <image>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIGS = {  # label -> (engine arguments, whether the arrivals carry images)
    "(a) chunked 512": ({"max_num_batched_tokens": CHUNK_BUDGET}, True),
    "(b) --disable-chunked-mm-input": ({"max_num_batched_tokens": CHUNK_BUDGET, "disable_chunked_mm_input": True},
                                       True),
    "(c) chunked prefill off": ({"enable_chunked_prefill": False}, True),
    "(d) text arrivals (baseline)": ({"max_num_batched_tokens": CHUNK_BUDGET}, False),
}


@dataclass(frozen=True)
class Shapes:
    """The model's shapes and the workload's sizes (the full run's or the smoke run's)."""

    name: str
    text: dict[str, Any]
    vision: dict[str, Any]
    scale_factor: int
    text_prompt_lens: tuple[int, ...]
    streams: int
    stream_output_len: int
    steps_before_arrivals: int
    arrival_every: int
    arrivals: int
    kv_cache_gb: float


FULL = Shapes(
    name="smolvlm-256m-shape",
    text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192),
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                image_size=512, patch_size=16),
    scale_factor=4, text_prompt_lens=(64, 256, 512), streams=8, stream_output_len=128, steps_before_arrivals=10,
    arrival_every=8, arrivals=4, kv_cache_gb=1.0)
SMOKE = Shapes(
    name="tiny",
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=100000.0, max_position_embeddings=1024),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=64, patch_size=8),
    scale_factor=2, text_prompt_lens=(16, 64), streams=2, stream_output_len=24, steps_before_arrivals=2,
    arrival_every=3, arrivals=2, kv_cache_gb=0.05)


def log(message: str) -> None:
    print(f"[multimodal] {message}", file=sys.stderr, flush=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ----- the model -----------------------------------------------------------------------------


def build_model(shapes: Shapes, folder: str) -> str:
    """A random-weight Idefics3 of `shapes` with its processor, saved in `folder` (once: a folder
    holding config.json is taken as built)."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    from chunkserve.config.model import resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer

    log(f"building the {shapes.name} model in {folder}")
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    text = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                       **shapes.text)
    vision = Idefics3VisionConfig(**shapes.vision)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=shapes.scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    size = shapes.vision["image_size"]
    image_seq_len = (size // shapes.vision["patch_size"]) ** 2 // shapes.scale_factor**2
    image_processor = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": size},
                                             max_image_size={"longest_edge": size})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len,
                                  chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def random_image(seed: int, size: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def data_url(image: Any) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def load_engine(model: str, engine_args: dict[str, Any], shapes: Shapes) -> LLM:
    """The engine, warmed up by one image prompt and one text prompt."""
    llm = LLM(model, kv_cache_memory_gb=shapes.kv_cache_gb, **engine_args)
    llm.chat([image_message(random_image(2**32 - 1, shapes.vision["image_size"]))], greedy(2), use_tqdm=False)
    llm.generate([list(range(100, 164))], greedy(2), use_tqdm=False)
    return llm


def image_message(image: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                        {"type": "text", "text": IMAGE_TEXT}]}


# ----- 1. encoder cost per image -------------------------------------------------------------


def encoder_and_chunk_costs(llm: LLM, shapes: Shapes, images: int, rng: np.random.Generator,
                            first_seed: int) -> dict[str, Any]:
    """The median encoder seconds per image over `images` distinct images, and the median EXTEND
    step duration of text prompts of each length in shapes.text_prompt_lens."""
    first = len(llm.get_step_records())
    for seed in range(first_seed, first_seed + images):
        llm.chat([image_message(random_image(seed, shapes.vision["image_size"]))], greedy(1), use_tqdm=False)
    encoded = [r for r in llm.get_step_records()[first:] if r.num_encoder_inputs > 0]
    if sum(r.num_encoder_inputs for r in encoded) != images:
        raise RuntimeError(f"{images} distinct images, {sum(r.num_encoder_inputs for r in encoded)} encoded")
    chunk_ms = {}
    for length in shapes.text_prompt_lens:
        first = len(llm.get_step_records())
        for _ in range(3):
            llm.generate(rng.integers(*TOKEN_ID_RANGE, size=(1, length)).tolist(), greedy(1), use_tqdm=False)
        extends = [r.duration_s for r in llm.get_step_records()[first:] if r.forward_mode == ForwardMode.EXTEND]
        chunk_ms[length] = 1000 * statistics.median(extends)
    return {"encoder_ms_per_image": 1000 * statistics.median(r.encoder_s / r.num_encoder_inputs for r in encoded),
            "image_tokens": encoded[0].num_encoder_embeds // encoded[0].num_encoder_inputs,
            "chunk_step_ms": chunk_ms}


# ----- 2. decode TBT while image prompts arrive ----------------------------------------------


def step_until_done(llm: LLM, finished: dict[str, RequestOutput], steps: int | None = None) -> None:
    """Step the engine (at most `steps` times), keeping each request's final output."""
    taken = 0
    while llm.engine.has_unfinished_requests() and (steps is None or taken < steps):
        finished.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        taken += 1


def arrival_prompts(llm: LLM, shapes: Shapes, with_images: bool, rng: np.random.Generator,
                    first_seed: int) -> list[Any]:
    """The arriving prompts: one distinct image and IMAGE_TEXT each, or random token ids of the
    same count (the baseline)."""
    processor = llm.engine.input_processor
    prompts = [engine_prompt({"prompt": processor.mm_processor.image_placeholder + IMAGE_TEXT,
                              "multi_modal_data": {"image": random_image(seed, shapes.vision["image_size"])}},
                             processor)
               for seed in range(first_seed, first_seed + shapes.arrivals)]
    if with_images:
        return prompts
    return [rng.integers(*TOKEN_ID_RANGE, size=len(p.token_ids)).tolist() for p in prompts]


def interference(llm: LLM, label: str, shapes: Shapes, arrivals: list[Any], rng: np.random.Generator) -> dict:
    """The streams' inter-token gaps and the arrivals' TTFTs as `arrivals` come in mid-decode."""
    streams = [f"{label}-stream-{i}" for i in range(shapes.streams)]
    for request_id in streams:
        prompt = rng.integers(*TOKEN_ID_RANGE, size=64).tolist()
        llm.engine.add_request(request_id, prompt, greedy(shapes.stream_output_len))
    finished: dict[str, RequestOutput] = {}
    step_until_done(llm, finished, shapes.steps_before_arrivals)
    arrival_ids = []
    for index, prompt in enumerate(arrivals):
        arrival_ids.append(f"{label}-arrival-{index}")
        llm.engine.add_request(arrival_ids[-1], prompt, greedy(4))
        step_until_done(llm, finished, shapes.arrival_every)
    if any(s in finished for s in streams):
        raise RuntimeError("a stream finished before the last arrival: raise stream_output_len")
    step_until_done(llm, finished)
    gaps_ms = 1000 * np.concatenate([np.diff(finished[s].metrics.token_times) for s in streams])
    ttfts = [finished[a].metrics.first_token_time - finished[a].metrics.arrival_time for a in arrival_ids]
    return {"gap_p50_ms": float(np.percentile(gaps_ms, 50)), "gap_p99_ms": float(np.percentile(gaps_ms, 99)),
            "gap_max_ms": float(gaps_ms.max()), "arrival_ttft_ms": 1000 * statistics.median(ttfts),
            "arrival_tokens": len(arrivals[0] if isinstance(arrivals[0], list) else arrivals[0].token_ids)}


def run_interference(model: str, shapes: Shapes, rounds: int, dtype: str) -> dict[str, dict[str, float]]:
    """Each configuration once per round (the order reversed every other round); the medians."""
    runs: dict[str, list[dict]] = {label: [] for label in CONFIGS}
    seed = 1000
    for round_index in range(rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        for label in order:
            engine_args, with_images = CONFIGS[label]
            log(f"round {round_index + 1}: {label}")
            llm = load_engine(model, {**engine_args, "dtype": dtype}, shapes)
            rng = np.random.default_rng(seed)
            arrivals = arrival_prompts(llm, shapes, with_images, rng, seed)
            runs[label].append(interference(llm, f"r{round_index}", shapes, arrivals, rng))
            seed += shapes.arrivals
            del llm
    return {label: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for label, results in runs.items()}


# ----- report --------------------------------------------------------------------------------


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def cost_table(costs: dict[str, dict[str, Any]]) -> str:
    lengths = list(next(iter(costs.values()))["chunk_step_ms"])
    headers = ["dtype", "encoder ms / image", "image tokens", *(f"{n}-token EXTEND step ms" for n in lengths)]
    rows = [[dtype, f"{c['encoder_ms_per_image']:.1f}", str(c["image_tokens"]),
             *(f"{c['chunk_step_ms'][n]:.1f}" for n in lengths)] for dtype, c in costs.items()]
    return markdown(headers, rows)


def interference_table(results: dict[str, dict[str, float]]) -> str:
    rows = [[label, f"{r['gap_p50_ms']:.1f}", f"{r['gap_p99_ms']:.1f}", f"{r['gap_max_ms']:.1f}",
             f"{r['arrival_ttft_ms']:.1f}", str(int(r["arrival_tokens"]))] for label, r in results.items()]
    return markdown(["config", "TBT p50 ms", "TBT p99 ms", "TBT max ms", "arrival TTFT ms (median)",
                     "arrival tokens"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_smoke_flag(parser)
    parser.add_argument("--model-dir", default=None,
                        help="where the random-weight model is built and cached (default: "
                             "<temp dir>/chunkserve-bench-multimodal-<shapes>)")
    parser.add_argument("--images", type=int, default=8, help="distinct images timed through the encoder")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four configurations")
    parser.add_argument("--json", default=None, help="write every number to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    images, rounds = (2, 1) if args.smoke else (args.images, args.rounds)
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"chunkserve-bench-multimodal-{shapes.name}")
    model = build_model(shapes, model_dir)
    host = machine()
    described = f"{host['cpu']} ({host['cpus']} CPUs), torch {torch.__version__} ({torch.get_num_threads()} threads)"
    dtypes = list(dict.fromkeys(["float32", auto_dtype()]))
    costs = {}
    for dtype in dtypes:
        log(f"encoder cost, {dtype}")
        llm = load_engine(model, {"dtype": dtype, "max_num_batched_tokens": CHUNK_BUDGET}, shapes)
        costs[dtype] = encoder_and_chunk_costs(llm, shapes, images, np.random.default_rng(0), first_seed=1)
        del llm
    tbt = run_interference(model, shapes, rounds, dtypes[-1])
    print(f"machine: {described}")
    print(f"model: random-weight Idefics3, {shapes.name} ({model_dir})\n")
    print(f"encoder cost per image (median of {images} distinct images) and decoder chunk steps:")
    print(cost_table(costs) + "\n")
    print(f"decode TBT while image prompts arrive ({dtypes[-1]}): {shapes.streams} streams (64-token prompts, "
          f"{shapes.stream_output_len} output tokens), {shapes.arrivals} arrivals (max_tokens 4) every "
          f"{shapes.arrival_every} steps after {shapes.steps_before_arrivals}; medians of {rounds} round(s)")
    print(interference_table(tbt))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": host, "torch_threads": torch.get_num_threads(),
                       "shapes": shapes.name, "encoder_cost": costs, "interference": tbt}, f, indent=2)


if __name__ == "__main__":
    main()
