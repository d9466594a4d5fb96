"""The scheduler's read-only views: counters (SchedulerStats) and slot waste (KVWaste)."""

from __future__ import annotations

from scheduler.outputs import KVWaste, SchedulerStats


class SchedulerObservability:
    """Mixed into Scheduler: reads its running set, KV cache manager and counters."""

    @property
    def stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.pool
        sliding = self.kv_cache_manager.sliding
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_used_blocks=pool.num_used_blocks,
            # The fuller pool's share (with sliding accounting: the global pool holds no memory when
            # every layer slides, and the sliding pool is sized never to run short otherwise).
            kv_cache_usage=max(pool.num_used_blocks / (pool.num_blocks - 1), 0.0 if sliding is None else
                               sliding.pool.num_used_blocks / (sliding.pool.num_blocks - 1)),
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_evictions=pool.num_evictions,
            num_steps=self._num_steps,
            num_sliding_used_blocks=0 if sliding is None else sliding.pool.num_used_blocks,
        )

    def kv_waste(self) -> KVWaste:
        """Slots held by running requests' tables versus slots holding computed tokens. O(running)."""
        kv = self.kv_cache_manager
        return KVWaste(
            num_allocated_slots=sum(kv.num_allocated_slots(rid) for rid in self.running),
            num_token_slots=sum(r.num_computed_tokens for r in self.running.values()),
            num_requests=len(self.running),
        )
