"""When a request is done, judged on token ids. Stop strings are matched on text by the
frontend's output processor, which then aborts the request in the engine core."""

from __future__ import annotations

from chunkserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status for a request whose last output token was just appended, or None."""
    params = request.sampling_params
    last_token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last_token in params.stop_token_ids:
            request.stop_reason = last_token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
