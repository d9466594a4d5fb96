"""Reading a StepResult: validation before anything changes, and why a token ends a request."""

from __future__ import annotations

from scheduler.outputs import SchedulerOutput, StepResult
from scheduler.request import FinishReason, Request, RequestStatus


def finish_reason(request: Request, token: int, max_model_len: int) -> FinishReason | None:
    if (token == request.eos_token_id and not request.ignore_eos) or (
        token in request.stop_token_set
    ):
        return FinishReason.STOP
    if (
        len(request.output_token_ids) >= request.max_tokens
        or request.num_tokens >= max_model_len
    ):
        return FinishReason.LENGTH
    return None


def append_tokens(request: Request, tokens: list[int], max_model_len: int) -> FinishReason | None:
    """Appends a step's tokens in order, stopping at the first that finishes the request."""
    if len(tokens) == 1:  # the common case, spelled out: this runs for every decode
        request.output_token_ids.append(tokens[0])
        return finish_reason(request, tokens[0], max_model_len)
    reason = None
    for token in tokens:
        request.output_token_ids.append(token)
        reason = finish_reason(request, token, max_model_len)
        if reason is not None:
            break
    # Drafts past a stop were computed but are not tokens of the request.
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    return reason


def check_step_result(output: SchedulerOutput, result: StepResult, pending: dict):
    """Validates a StepResult against its output before anything changes, so a bad result
    leaves the scheduler as it was. Returns ({req_id: tokens}, {req_id: rejected} or None)."""
    n = len(result.req_ids)
    if len(result.sampled_token_ids) != n or (
        result.num_rejected_tokens is not None and len(result.num_rejected_tokens) != n
    ):
        raise ValueError(
            f"StepResult.req_ids ({n}), sampled_token_ids ({len(result.sampled_token_ids)}) "
            "and num_rejected_tokens must be parallel lists"
        )
    sampled = dict(zip(result.req_ids, result.sampled_token_ids))
    rejected = (
        dict(zip(result.req_ids, result.num_rejected_tokens))
        if result.num_rejected_tokens is not None
        else None
    )
    missing, bad = [], []
    for sr in output.scheduled:
        if sr.num_logits == sr.num_prompt_logits or pending[sr.req_id].status is not RequestStatus.RUNNING:
            continue  # samples nothing (a prefill chunk, a scored prompt chunk), or gone
        tokens = sampled.get(sr.req_id)
        if tokens is None:
            missing.append(sr.req_id)
        elif not 1 <= len(tokens) <= sr.num_logits - sr.num_prompt_logits or (
            rejected is not None
            and not 0 <= rejected[sr.req_id] < min(sr.num_scheduled_tokens, sr.num_logits)
        ):
            bad.append(sr.req_id)
    if missing:
        raise ValueError(
            f"StepResult has no sampled token for {missing}, scheduled with num_logits > 0"
        )
    if bad:
        raise ValueError(
            f"StepResult for {bad}: each row keeps 1..num_logits tokens and rejects fewer "
            "positions than it sampled"
        )
    return sampled, rejected
