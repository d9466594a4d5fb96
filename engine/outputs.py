"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shape).

Text and token ids are cumulative (everything generated so far), so a caller that streams keeps how
much it has already sent and sends the rest.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str  # generated text so far (stop string excluded)
    token_ids: list[int]  # generated token ids so far
    finish_reason: str | None = None  # None while running; "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token id: logprob}
    cumulative_logprob: float | None = None
    error: str | None = None  # set when the sequence failed (finish_reason "abort")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (its own and the top
    # n), None for the first; set once the whole prompt is scored.
    prompt_logprobs: list[dict[int, float] | None] | None = None
