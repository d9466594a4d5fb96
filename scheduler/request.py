"""A request as the scheduler sees it: token ids, progress through the KV cache, and a status.

Invariant: `num_computed_tokens <= num_tokens`; the tokens in `[num_computed_tokens, num_tokens)`
still need their K/V written. A decoding request has exactly one such token (the last sampled one).
"""

from __future__ import annotations

import enum
import time


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, holds no blocks (never admitted, or preempted)
    RUNNING = "running"  # admitted: owns a block table, scheduled at every step the budget allows
    FINISHED = "finished"  # stopped (EOS, stop token, length, or a stop decided by the engine)
    ABORTED = "aborted"  # cancelled by the caller


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop the engine decided (stop strings)
    LENGTH = "length"  # max_tokens reached, or the sequence reached max_model_len
    ABORT = "abort"  # cancelled by the caller


class Request:
    """One generation request. The scheduler mutates it; callers read it.

    `block_hashes` holds the prefix-cache hash of each full block of `all_token_ids`, computed once
    per block (the prompt's at `add_request`, later ones as decoding fills them).
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "max_tokens",
        "eos_token_id",
        "stop_token_ids",
        "stop_token_set",
        "ignore_eos",
        "priority",
        "arrival_time",
        "output_token_ids",
        "num_computed_tokens",
        "status",
        "finish_reason",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "sampling",
        "group_id",
        "spec_token_ids",
        "prompt_logprobs",
        "lora_id",
        "_admitted",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        eos_token_id: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float | None = None,
        sampling: object = None,
        group_id: str | None = None,
        prompt_logprobs: bool = False,
        lora_id: int = 0,
    ) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"Request.max_tokens must be a positive integer, got {max_tokens!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"Request.priority must be an integer, got {priority!r}")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.stop_token_ids = tuple(stop_token_ids)
        # A set makes the per-token stop check O(1) however many stop ids there are.
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.ignore_eos = ignore_eos
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = 0  # prefix-cache hit tokens at the first admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        # The engine's per-request sampling state, handed to the runner in NewRequestData; the
        # scheduler never reads it.
        self.sampling = sampling
        # Requests of one client request (its prompts, its n samples) share a group: the fairness
        # cap (SchedulerConfig.max_seqs_per_group) counts running requests per group.
        self.group_id = req_id if group_id is None else group_id
        # Draft tokens to verify in the next step (speculative decoding), set by the engine's
        # proposer before schedule(); schedule() consumes them (clamped to the budget, max_tokens
        # and max_model_len) and clears them. They are not tokens of the request until accepted.
        self.spec_token_ids: list[int] = []
        # Score every prompt position (prompt logprobs, `echo` with `logprobs`): until its prompt
        # is computed the request skips the prefix cache, and each prompt chunk samples at all of
        # its positions (ScheduledRequest.num_prompt_logits); update() clears it then.
        self.prompt_logprobs = bool(prompt_logprobs)
        # The LoRA adapter it runs with (the engine's key of one adapter load, engine/lora/), 0 =
        # the base model: its prefix-cache hashes start from its own root (block_pool.root_hash),
        # and at most SchedulerConfig.max_loras distinct ones run at once (lora_seats.py).
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 0:
            raise ValueError(f"Request.lora_id must be an integer >= 0, got {lora_id!r}")
        self.lora_id = lora_id
        self._admitted = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs; a new list (O(num_tokens)); hot paths use `token_slice`."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode is O(1))."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.value}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
