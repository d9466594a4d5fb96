"""PDEngine's statistics: the two pools' EngineStats joined into one, and the KV transfers'.

Prompt and generated tokens are counted where they are made: prompts and first tokens in the
prefill pool, the rest in the decode pool. Counters and occupancy are summed over the pools,
fractions averaged; each pool's own stats stay in `replicas` (named by `pool_names`).
"""

from __future__ import annotations

import dataclasses

from engine.core.engine_stats import EngineStats
from engine.disaggregation.local_pool import DecodePool

POOLS = ("prefill", "decode")
# Summed over the pools in the aggregate EngineStats.
SUMMED = ("num_running", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
          "num_generation_tokens", "num_steps", "num_free_blocks", "num_cached_blocks", "num_failed_steps",
          "num_constrained_requests", "num_grammars_compiled", "grammar_compile_seconds", "mask_fill_seconds",
          "num_mask_steps")


def aggregate(prefill: EngineStats, decode: EngineStats | None, kv_transfer, *, num_pending_transfers: int,
              degraded_reason: str | None) -> EngineStats:
    """One EngineStats for both pools; decode None (a lost pool that never reported) counts as zeros."""
    per = [prefill]
    per.append(decode if decode is not None else dataclasses.replace(
        prefill, **dict.fromkeys(SUMMED, 0), num_waiting=0, kv_cache_usage=0.0, padded_token_fraction=0.0))
    total = {name: sum(getattr(s, name) for s in per) for name in SUMMED}
    return dataclasses.replace(
        per[0], **total, num_prompt_tokens=per[0].num_prompt_tokens,
        num_waiting=per[0].num_waiting + per[1].num_waiting,
        kv_cache_usage=sum(s.kv_cache_usage for s in per) / 2,
        padded_token_fraction=sum(s.padded_token_fraction for s in per) / 2,
        weight_bytes_per_device=tuple(b for s in per for b in s.weight_bytes_per_device),
        kv_cache_bytes_per_device=tuple(b for s in per for b in s.kv_cache_bytes_per_device),
        spec_decode=None, replicas=tuple(per), pool_names=POOLS, kv_transfer=kv_transfer,
        num_pending_transfers=num_pending_transfers, degraded_reason=degraded_reason)


def transfer_stats(clock, decode):
    """The transfers' stats: timed here in one process; in another process's decode pool, timed
    and decided where they land (its pulls and fallbacks)."""
    stats = clock.snapshot()
    if not isinstance(decode, DecodePool):
        stats.seconds, stats.num_landed = decode.pull_seconds, decode.num_pulled
        stats.num_fallbacks = decode.num_fallbacks
    return stats
