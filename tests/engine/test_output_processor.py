"""The frontend's output processor: the engine core's new token ids become each request's
text and output; stop strings end a request here and ask the core to abort it."""

from __future__ import annotations

from chunkserve.core.messages import EngineCoreOutput, TokenLogprobs
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.sampling_params import SamplingParams


def start(tokenizer, params: SamplingParams, request_id: str = "r") -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    processor.add_request(EngineCoreRequest(request_id, [1, 2, 3], params, None, arrival_time=100.0), "hi")
    return processor


def test_outputs_accumulate_text_tokens_and_times(default_tokenizer):
    ids = default_tokenizer.encode(" one two three four")
    processor = start(default_tokenizer, SamplingParams(max_tokens=10))
    first = processor.process_outputs([EngineCoreOutput("r", ids[:2], None, first_scheduled_time=100.5)], 101.0)
    (output,) = first.request_outputs
    assert output.outputs[0].new_token_ids == ids[:2] and not output.finished
    done = processor.process_outputs([EngineCoreOutput("r", ids[2:], None, "length")], 102.0).request_outputs[0]
    completion = done.outputs[0]
    assert done.finished and completion.finish_reason == "length"
    assert completion.token_ids == ids and completion.text == " one two three four"
    assert output.outputs[0].text_delta + completion.text_delta == completion.text
    assert done.metrics.token_times == [101.0, 101.0] + [102.0] * (len(ids) - 2)
    assert done.metrics.first_scheduled_time == 100.5 and done.metrics.finished_time == 102.0
    assert not processor.has_request("r")


def test_a_stop_string_inside_a_multi_token_step_cuts_it_and_asks_the_core_to_abort(default_tokenizer):
    ids = default_tokenizer.encode(" alpha beta STOP gamma delta")
    logprobs = [TokenLogprobs(t, -1.0, []) for t in ids]
    processor = start(default_tokenizer, SamplingParams(max_tokens=20, stop=["STOP"], logprobs=0))
    processed = processor.process_outputs([EngineCoreOutput("r", ids, logprobs)], 101.0)
    (output,) = processed.request_outputs
    completion = output.outputs[0]
    assert processed.requests_to_abort == ["r"]
    assert output.finished and completion.finish_reason == "stop" and completion.stop_reason == "STOP"
    assert completion.text == " alpha beta "
    kept = len(completion.token_ids)
    assert kept < len(ids) and completion.new_token_ids == ids[:kept] == completion.token_ids
    assert completion.logprobs == logprobs[:kept] == completion.new_logprobs
    # the core's own abort of it, arriving later, is ignored
    assert processor.process_outputs([EngineCoreOutput("r", [], None, "abort")], 102.0).request_outputs == []


def test_a_stop_string_before_the_cores_own_finish_wins(default_tokenizer):
    ids = default_tokenizer.encode(" x STOP y")
    processor = start(default_tokenizer, SamplingParams(max_tokens=len(ids), stop=["STOP"]))
    processed = processor.process_outputs([EngineCoreOutput("r", ids, None, "length")], 101.0)
    assert processed.requests_to_abort == []  # the core finished it already
    assert processed.request_outputs[0].outputs[0].finish_reason == "stop"


def test_an_abort_flushes_held_back_text(default_tokenizer):
    ids = default_tokenizer.encode(" wait for ST")
    processor = start(default_tokenizer, SamplingParams(max_tokens=20, stop=["STOP"]))
    held = processor.process_outputs([EngineCoreOutput("r", ids, None)], 101.0).request_outputs[0]
    aborted = processor.process_outputs([EngineCoreOutput("r", [], None, "abort")], 102.0).request_outputs[0]
    assert not held.outputs[0].text.endswith("ST")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert held.outputs[0].text_delta + aborted.outputs[0].text_delta == " wait for ST"
