"""Images through the whole offline engine (LLM.chat / LLM.generate -> scheduler -> worker) on
tiny random vision-language models: greedy tokens equal transformers' for budgets whose chunks
cut through the image rows, each image is encoded once per request and not again when it repeats,
a different image of the same size never reuses another's KV, text decodes keep one token per
step while an image prompt prefills, and an abort mid-image leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.sampling_params import StructuredOutputsParams
from chunkserve.entrypoints.llm import engine_prompt
from chunkserve.errors import InvalidRequestError
from tests.engine.support import assert_pool_free
from tests.multimodal_models import build_vlm, png_data_url, random_image

GREEDY_STEPS = 32


def greedy(max_tokens: int = GREEDY_STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def chat_with(*images, text: str = "What is in these pictures?", as_template: bool = False) -> list[dict]:
    """A chat with the images as OpenAI image_url parts (`as_template`: as the chat template's
    {"type": "image"} parts, for transformers' processor)."""
    parts = [{"type": "image"} if as_template else {"type": "image_url", "image_url": {"url": png_data_url(image)}}
             for image in images]
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts, {"type": "text", "text": text}]}]


def engine_of(folder: str, **flags) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_gb=0.02, **flags)


def image_prompt(llm: LLM, text: str, *images):
    """vLLM's prompt dict with multi_modal_data, as LLMEngine.add_request takes it (expanded)."""
    return engine_prompt({"prompt": text, "multi_modal_data": {"image": list(images)}}, llm.engine.input_processor)


def encoder_runs(llm: LLM, first_record: int) -> int:
    return sum(r.num_encoder_inputs for r in llm.get_step_records()[first_record:])


@torch.inference_mode()
def transformers_greedy(folder: str, prompt_token_ids: list[int], images) -> list[int]:
    """transformers' greedy tokens for the images as its processor prepares them (Qwen2-VL's
    without torchvision: its image processor), from our prompt ids, which must be its own."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    ids = torch.tensor([prompt_token_ids])
    if model.config.model_type == "qwen2_vl":
        pixels = dict(AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt"))
        pixels["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
    else:
        processor = AutoProcessor.from_pretrained(folder)
        text = processor.apply_chat_template(chat_with(*([None] * len(images)), as_template=True),
                                             add_generation_prompt=True)
        pixels = dict(processor(text=text, images=images, return_tensors="pt"))
        assert pixels.pop("input_ids").tolist() == ids.tolist(), "our prompt ids are not the processor's"
        pixels.pop("attention_mask")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_STEPS,
                         min_new_tokens=GREEDY_STEPS, do_sample=False, **pixels)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("architecture", ["llava", "idefics3", "qwen2_vl"])
def test_greedy_tokens_equal_transformers_with_chunks_through_the_images(tmp_path, architecture):
    folder = build_vlm(architecture, str(tmp_path))


    images = [random_image(1), random_image(2, 60, 30)]
    llm = engine_of(folder, block_size=4, max_num_batched_tokens=4)  # 4-token chunks cut through each image
    first = len(llm.get_step_records())
    out = llm.chat(chat_with(*images), greedy())[0]
    prefill_steps = [r for r in llm.get_step_records()[first:] if r.num_prefill_tokens]
    assert len(prefill_steps) >= 3, "the prompt was not chunked"
    assert encoder_runs(llm, first) == 2  # each image once, across the chunks that read it
    assert list(out.outputs[0].token_ids) == transformers_greedy(folder, out.prompt_token_ids, images)
    assert llm.engine.engine_core.check()["ok"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_vlm("llava", str(tmp_path_factory.mktemp("llava")))


def test_a_repeated_image_is_not_encoded_again_and_a_different_one_never_reuses_its_kv(llava):
    llm = engine_of(llava, max_num_batched_tokens=16)
    same, other = random_image(5), random_image(6)  # the same size: the same placeholder token ids
    first = len(llm.get_step_records())
    alone = llm.chat(chat_with(same), greedy(8))[0]
    assert encoder_runs(llm, first) == 1
    first = len(llm.get_step_records())
    again = llm.chat(chat_with(same), greedy(8))[0]
    assert encoder_runs(llm, first) == 0  # the image's rows come from the prefix cache
    assert again.num_cached_tokens > alone.num_cached_tokens
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids

    first = len(llm.get_step_records())
    different = llm.chat(chat_with(other), greedy(8))[0]
    assert encoder_runs(llm, first) == 1
    image_start = different.prompt_token_ids.index(llm.engine.engine_core.model_config.multimodal.image_token_id)
    assert different.num_cached_tokens <= image_start  # only the text before the image was reused
    fresh = engine_of(llava, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert different.outputs[0].token_ids == fresh.chat(chat_with(other), greedy(8))[0].outputs[0].token_ids


def test_text_decodes_keep_one_token_per_step_while_an_image_prompt_prefills(llava):
    llm = engine_of(llava, max_num_batched_tokens=16)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"text-{i}", f"Count to ten, number {i}.", greedy(40))
    running = engine.engine_core.scheduler.running
    while len(running) < 2 or not all(r.is_decoding for r in running):
        engine.step()
    first = len(llm.get_step_records())
    engine.add_request("image", image_prompt(llm, "USER: <image> What is it? ASSISTANT:", random_image(7)), greedy(2))
    while not any(r.request_id == "image" and r.is_decoding for r in engine.engine_core.scheduler.running):
        engine.step()
    prefill_steps = [r for r in llm.get_step_records()[first:] if r.num_prefill_tokens]
    assert len(prefill_steps) >= 2 and encoder_runs(llm, first) == 1
    assert all(r.num_decode_tokens == 2 for r in prefill_steps)  # no decode stalled for the image
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.engine.engine_core.check()["ok"]


def test_an_abort_mid_image_releases_everything(llava):
    llm = engine_of(llava, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("aborted", image_prompt(llm, "USER: <image> <image> Describe. ASSISTANT:", random_image(8),
                                               random_image(9)), greedy(4))
    engine.step()  # the first chunk: the first image is encoded, its rows are half in the KV cache
    assert llm.get_step_records()[-1].num_encoder_inputs == 1
    engine.abort_request("aborted")
    report = llm.engine.engine_core.check()
    assert report["ok"], report["problems"]
    assert_pool_free(llm)


def test_an_image_longer_than_the_budget_is_refused_at_start_up_without_chunked_images(llava):
    with pytest.raises(InvalidRequestError, match=r"Chunked MM input disabled but max_tokens_per_mm_item \(16\) "
                                                  r"is larger than max_num_batched_tokens \(8\)"):
        engine_of(llava, block_size=8, max_num_batched_tokens=8, disable_chunked_mm_input=True)
    llm = engine_of(llava, block_size=8, max_num_batched_tokens=8)  # without the flag, the image splits
    out = llm.chat(chat_with(random_image(10)), greedy(4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_ngram_speculation_and_structured_outputs_compose_with_images(llava):
    """They act on the generated tokens only: speculation keeps the greedy tokens exact, a
    grammar's choice is one of its strings, with an image prompt chunked through its image."""
    messages = chat_with(random_image(11))
    plain = engine_of(llava, max_num_batched_tokens=16).chat(messages, greedy(24))[0].outputs[0].token_ids
    speculative = engine_of(llava, max_num_batched_tokens=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "policy": "always"})
    assert speculative.chat(messages, greedy(24))[0].outputs[0].token_ids == plain
    choices = ["a cat", "a dog"]
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=choices))
    assert speculative.chat(messages, params)[0].outputs[0].text in choices
