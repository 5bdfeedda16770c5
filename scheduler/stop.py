"""Stop conditions, checked after every sampled token (the scheduler's update step)."""

from __future__ import annotations

from collections.abc import Set

from scheduler.request import Request, RequestStatus


def check_stop(req: Request, eos_token_ids: Set[int], max_model_len: int) -> RequestStatus | None:
    """The finished status the request's newest token puts it in, or None to keep going.

    The stopping token itself stays in the output (like vLLM's token ids); the server leaves special
    tokens out of the text. EOS and stop ids count only once min_tokens are out.
    """
    n_out = len(req.output_token_ids)
    last = req.output_token_ids[-1]
    params = req.sampling
    if n_out >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if n_out >= params.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
