"""A step's budgets (tokens, logit rows): what one schedule() call has left (StepPlan), and how
much of them one request's row may take."""

from __future__ import annotations

from scheduler.outputs import ScheduledRequest
from scheduler.request import Request


def fit_logits(request: Request, num_new: int, remaining: int, logits_left: int, reserve: int = 0) -> int:
    """The chunk cut to the logit rows left. A prompt-scoring chunk (Request.prompt_logprobs)
    needs one per token and leaves `reserve` rows for the rows that may still join the step (at
    least one position a step while any row is left); any other chunk needs one if it reaches
    the request's last token (`remaining` tokens are uncomputed), which the bucket shapes always
    hold unless scored prompts took them. 0: the request waits for the next step."""
    if request.prompt_logprobs:
        return min(num_new, max(logits_left - max(reserve, 0), min(logits_left, 1)))
    return num_new if num_new < remaining or logits_left > 0 else 0


def clamp_drafts(request: Request, drafts: list[int], spare: int, max_model_len: int) -> list[int]:
    """Drafts within the spare budget that never carry the request past max_tokens (a bonus
    token comes on top) or its last position past max_model_len - 2."""
    room = min(spare, request.max_tokens - len(request.output_token_ids) - 1,
               max_model_len - 1 - request.num_tokens)
    return list(drafts[: max(room, 0)])


class StepPlan:
    """What one schedule() call has decided so far."""

    __slots__ = ("budget", "logits", "scheduled", "preempted", "admitted")

    def __init__(self, budget: int, logits: int) -> None:
        self.budget = budget
        self.logits = logits  # logit rows left (SchedulerConfig.max_num_logits)
        self.scheduled: dict[str, ScheduledRequest] = {}  # insertion order is the output order
        self.preempted: dict[str, None] = {}
        self.admitted: list[Request] = []  # started running in this step (new or resumed)
