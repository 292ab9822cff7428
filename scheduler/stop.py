"""Stop checks, in vLLM v1's order."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its latest output token; set its status if so.

    Order (vLLM v1): EOS (unless ``ignore_eos``) -> a stop token id -> length (``max_tokens``
    or ``max_model_len``). ``min_tokens`` is not a gate here: the sampler masks EOS and stop ids
    until ``min_tokens`` outputs exist, so an EOS that does arrive is honoured, as in vLLM.
    """
    token = request.output_token_ids[-1]
    if token == request.eos_token_id and not request.sampling_params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if token in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token
        return True
    if (
        len(request.all_token_ids) >= max_model_len
        or len(request.output_token_ids) >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_and_check_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append sampled tokens one at a time, stopping at the first that ends the request.

    Returns the tokens kept and whether the request stopped. Tokens after the stop are
    dropped (never appended).
    """
    outputs, all_tokens = request.output_token_ids, request.all_token_ids
    for i, token in enumerate(token_ids):
        outputs.append(token)
        all_tokens.append(token)
        if check_stop(request, max_model_len):
            return token_ids[: i + 1], True
    return token_ids, False
