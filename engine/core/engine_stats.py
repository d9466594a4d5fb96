"""What LLMEngine reports about itself (EngineStats, a snapshot) and the error of a dead engine."""

from __future__ import annotations

import dataclasses

from engine.spec_decode.controller import SpecDecodeStats


class EngineDeadError(RuntimeError):
    """The runner lost its device state; the engine cannot serve any more."""


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used blocks / usable blocks
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, found cached
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens of requests added
    num_generation_tokens: int  # tokens generated
    num_compilations: int  # XLA compilations in this process
    num_steps: int
    num_free_blocks: int
    num_cached_blocks: int
    padded_token_fraction: float  # padding tokens / all tokens fed so far
    num_failed_steps: int = 0  # steps whose runner call raised
    spec_decode: SpecDecodeStats | None = None  # speculative decoding counters; None: off
    num_constrained_requests: int = 0  # requests added with structured output
    num_grammars_compiled: int = 0  # grammar LRU misses
    grammar_compile_seconds: float = 0.0  # total time building grammars (on the callers' threads)
    mask_fill_seconds: float = 0.0  # host time filling token masks in the step loop
    num_mask_steps: int = 0  # steps that filled at least one token mask
    # sliding-window accounting (scheduler/sliding_window.py): blocks in use in the sliding layers'
    # pool (the counts above are the global layers'); 0 without it
    num_sliding_used_blocks: int = 0
    weight_bytes_per_device: tuple[int, ...] = ()  # the weights' shards on each device of the group
    kv_cache_bytes_per_device: tuple[int, ...] = ()  # the KV cache's shards on each device
    replicas: tuple = ()  # data parallelism (engine/scaleout/dp_engine.py): each replica's own EngineStats
    router: object = None  # data parallelism: engine/scaleout/router.RouterStats
    pool_names: tuple[str, ...] = ()  # disaggregation (engine/disaggregation/pd_engine.py): `replicas` are these pools
    kv_transfer: object = None  # disaggregation: engine/disaggregation/kv_transfer.TransferStats
    num_pending_transfers: int = 0  # disaggregation: moved requests the decode pool has not admitted yet
    degraded_reason: str | None = None  # why the engine serves in a degraded mode (disaggregation: the
    # decode pool is lost and the prefill pool decodes every request itself); None: it is not
