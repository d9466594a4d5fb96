"""PDEngine's handover: a prefilled request's full prompt blocks found in the prefill pool's
prefix cache by their hashes, gathered and sent towards the decode pool's devices at once
(kv_transfer.py), then landed in the decode pool when it is idle (its scheduler admits the request
as a prefix hit on them; pd_engine.py's docstring, steps 2 and 3)."""

from __future__ import annotations

import dataclasses
import time

import jax

from engine.core.engine_stats import EngineDeadError
from engine.core.request_state import Resume
from engine.disaggregation.local_pool import DecodePool, failed_output
from engine.disaggregation.pd_degraded import Decoding, Pending
from engine.outputs import RequestOutput
from scheduler import block_pool
from scheduler.block_pool import hash_block_tokens


class Handover:
    """PDEngine's handover (a mixin: it uses PDEngine's pools, gather, clock and request maps)."""

    def _gather(self, ids: list[int]):
        """The prompt's full blocks, gathered from the prefill pool (idle now) and, in one
        process, already on their way to the decode pool's devices: (hashes, k, v)."""
        bs, hashes, parent = self.block_size, [], block_pool.ROOT_BLOCK_HASH
        for i in range(len(ids) // bs):
            parent = hash_block_tokens(parent, ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        lookup, source = self.prefill.scheduler.kv_cache_manager.pool.lookup, []
        for h in hashes:  # the leading blocks still in the prefill pool's cache (all, normally)
            block = lookup(h)
            if block is None:
                break
            source.append(block)
        if not source:
            return [], None, None
        k, v = self.gather.gather(source)
        if isinstance(self.decode, DecodePool):
            k, v = jax.device_put((k, v), self.decode.scatter.shardings)
        self.clock.started(len(source), len(source) * self.gather.block_bytes, (k, v))
        return hashes[: len(source)], k, v

    def _land_handovers(self) -> list[RequestOutput]:
        """Moves gathered requests into the decode pool while it is idle; failed outputs."""
        failed = []
        while (self._ready and self.degraded_reason is None and self._running["decode"] is None
               and self.decode.num_pending < self.max_pending):
            request_id, (pending, out, firsts, hashes, k, v) = self._ready.popitem(last=False)
            try:
                self._land(request_id, pending, out, firsts, hashes, k, v)
            except EngineDeadError as exc:  # the decode pool is lost: this request resumes here too
                self._degrade(exc)
            except Exception as exc:  # this request fails; the pools serve on
                if self._decoding.pop(request_id, None) is not None:
                    self.decode.abort_request(request_id)
                failed.append(failed_output(out, exc))
        return failed

    def _land(self, request_id: str, pending: Pending, out: RequestOutput, firsts, hashes, k, v) -> None:
        first_time = out.metrics.first_token_time or time.monotonic()
        self._decoding[request_id] = Decoding(pending, dataclasses.replace(out, outputs=firsts, finished=False),
                                               out.prompt_logprobs, first_time)
        landed = self.decode.hand_over(request_id, hashes, k, v, pending.prompt_ids, pending.params, pending.arrival,
                                       base_seed=pending.base_seed,
                                       resume=Resume(firsts, first_time, out.prompt_logprobs), **pending.kwargs)
        if landed is False:
            self.clock.fallback()  # the decode pool is full: it recomputes the prompt
