"""SchedulerConfig: the knobs of DESIGN.md section 3, validated once at construction."""

from __future__ import annotations

import dataclasses

POLICIES = ("fcfs", "priority", "static")
KV_ALLOCATIONS = ("paged", "contiguous")


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"SchedulerConfig.{name} must be {what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    # Most requests running at once (rows of the batch).
    max_num_seqs: int = 256
    # Token budget of one step: decodes (1 token each) plus prefill chunks.
    max_num_batched_tokens: int = 2048
    # Longest sequence (prompt + output); a request stops with "length" when it gets there.
    max_model_len: int = 2048
    # Tokens per KV block.
    block_size: int = 16
    # Blocks in the pool, including the null block 0 that is never handed out. The engine
    # usually computes this from a memory fraction.
    num_blocks: int = 1024
    # Reuse full blocks whose token prefix matches (hash chain over blocks).
    enable_prefix_caching: bool = True
    # Let a prompt that does not fit the remaining budget take part of it and continue next step.
    enable_chunked_prefill: bool = True
    # "fcfs" (continuous batching), "priority" (lower value first, may preempt), or the
    # "static" baseline (a new batch only when the previous one has completely finished).
    policy: str = "fcfs"
    # "paged" (blocks on demand) or the "contiguous" baseline (reserve max_model_len per request).
    kv_allocation: str = "paged"
    # Fairness: while requests of other groups wait, no group (one client request's prompts and
    # samples) holds more than this many running seats; None = no cap. Work-conserving: with
    # nobody else waiting a group may fill the batch.
    max_seqs_per_group: int | None = None
    # Most logit rows one step can hold (the runner's bucket with the most: with its scoring
    # bucket, a row per token of the largest token bucket, so the token budget binds first); only
    # prompt-scoring requests (Request.prompt_logprobs, one row per prompt position) come near it.
    # None: no cap beyond the token budget.
    max_num_logits: int | None = None
    # LoRA: most distinct adapters (Request.lora_id != 0) among the running requests (the runner's
    # device slots); 0 = adapters off, a request with one is refused.
    max_loras: int = 0
    # Sliding-window block accounting (a model mixing sliding-window and global layers): the
    # sliding layers' window W (a query at position p reads keys p - W + 1 .. p). They get a block
    # table and a pool of their own (scheduler/sliding_window.py) whose blocks the window has
    # passed are released; None: one block table for every layer (every block kept).
    sliding_window: int | None = None
    # With sliding_window: the sliding layers' pool, in blocks including their null block 0
    # (num_blocks is then the global layers' pool).
    num_sliding_blocks: int = 0

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("max_model_len", self.max_model_len, minimum=2)
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("num_blocks", self.num_blocks, minimum=2)
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"SchedulerConfig.max_loras must be an integer >= 0, got {self.max_loras!r}")
        self._check_sliding()
        if self.max_seqs_per_group is not None:
            _check_positive_int("max_seqs_per_group", self.max_seqs_per_group)
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.policy not in POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"SchedulerConfig.kv_allocation must be one of {KV_ALLOCATIONS}, "
                f"got {self.kv_allocation!r}"
            )
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                "SchedulerConfig.num_blocks is too small for one request of max_model_len tokens: "
                f"(num_blocks - 1) * block_size = ({self.num_blocks} - 1) * {self.block_size} < "
                f"max_model_len = {self.max_model_len}; raise num_blocks to at least "
                f"{self.max_blocks_per_seq + 1} or lower max_model_len"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode at every "
                "step; raise max_num_batched_tokens or lower max_num_seqs"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False, or a "
                "long prompt could never be scheduled; raise max_num_batched_tokens, lower "
                "max_model_len, or enable chunked prefill"
            )

    def _check_sliding(self) -> None:
        if self.sliding_window is None:
            if self.num_sliding_blocks:
                raise ValueError("SchedulerConfig.num_sliding_blocks needs sliding_window (the sliding "
                                 f"layers' window); got num_sliding_blocks={self.num_sliding_blocks!r}")
            return
        _check_positive_int("sliding_window", self.sliding_window)
        _check_positive_int("num_sliding_blocks", self.num_sliding_blocks, minimum=2)
        if self.kv_allocation == "contiguous" or self.policy == "static":
            raise ValueError("SchedulerConfig.sliding_window (sliding-window block accounting) is not "
                             "implemented with kv_allocation='contiguous' or policy='static' (the "
                             "baselines reserve whole sequences or prompts up front)")
        # One request's window and chunk span W - 1 + chunk positions: at most one block more
        # than they fill, and never more than a whole sequence's blocks.
        need = min(-(-(self.sliding_window - 1 + self.max_num_batched_tokens) // self.block_size) + 1,
                   self.max_blocks_per_seq)
        if self.num_sliding_blocks - 1 < need:
            raise ValueError(
                f"SchedulerConfig.num_sliding_blocks ({self.num_sliding_blocks}) cannot hold one request's "
                f"window and step ({need} blocks of {self.block_size} tokens, plus the null block)")

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one request of max_model_len tokens needs (the contiguous reservation)."""
        return -(-self.max_model_len // self.block_size)
