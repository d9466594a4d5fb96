"""PDEngine's degraded mode, and the records of a request it keeps to resume one elsewhere.

Degraded mode: when the decode pool is lost (its process killed, its connection gone, its
engine dead or its step raising), `degraded_reason` says why and the prefill engine decodes
everything itself from then on. Each request in flight resumes there with the tokens it had
returned so far (`Resume`), its prompt a prefix hit on the blocks the prefill pool still caches
and the rest (the tokens made in the lost pool, whose KV is gone with it) recomputed; one still
prefilling continues there once its first token comes. A seeded or greedy request gives the
tokens it would have given (the rng step is the output index). A request the prefill engine
cannot take fails with an error naming the lost pool. New requests are served there as by a
colocated engine; /health says "degraded" with the reason and /metrics' `jaxserve:engine_degraded`
is 1.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from engine.core.request_state import Resume
from engine.disaggregation.local_pool import failed_output
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine.disaggregation.pd_engine")


@dataclasses.dataclass
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    kwargs: dict
    base_seed: int
    max_tokens: int  # what the request may still generate in all, capped by max_model_len


@dataclasses.dataclass
class Decoding:
    """A request handed to the decode pool: what it needs to resume elsewhere if that pool is lost."""

    pending: Pending
    latest: RequestOutput  # the newest output returned for it (at first, its first tokens)
    prompt_logprobs: list | None
    first_token_time: float


class DegradedMode:
    """PDEngine's degraded mode (a mixin: it uses PDEngine's pools, its request maps and its
    deferred queues)."""

    def _degrade(self, exc: Exception) -> None:
        """The decode pool is lost: every request that was moving or decoding resumes in the
        prefill engine with the tokens it has returned; from now on that engine does all."""
        if self.degraded_reason is not None:
            return
        self.degraded_reason = f"the decode pool is lost ({type(exc).__name__}: {exc}); the prefill pool decodes itself"
        logger.error("disaggregation degraded: %s", self.degraded_reason)
        last = self.decode.last_stats()
        self._lost_stats = dataclasses.replace(last, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                               num_free_blocks=0, num_cached_blocks=0) if last is not None else None
        self.decode.abandon()
        self._deferred["decode"] = []
        moving = [(rid, d.pending, d.latest, d.prompt_logprobs, d.first_token_time) for rid, d in self._decoding.items()]
        moving += [(rid, pending, dataclasses.replace(out, outputs=firsts, finished=False), out.prompt_logprobs,
                    out.metrics.first_token_time or time.monotonic())
                   for rid, (pending, out, firsts, *_) in self._ready.items()]
        self._decoding.clear()
        self._ready.clear()
        self._failed += [f for f in (self._resume_here(*m) for m in moving) if f is not None]

    def _resume_here(self, request_id: str, pending: Pending, latest: RequestOutput, prompt_logprobs,
                     first_time: float) -> RequestOutput | None:
        """Queues the request in the prefill engine from its latest output; its failed output if
        that engine refuses it."""
        try:
            state = self.prefill.prepare_request(
                request_id, pending.prompt_ids, pending.params, pending.arrival, base_seed=pending.base_seed,
                resume=Resume(list(latest.outputs), first_time, prompt_logprobs),
                **pending.kwargs)
        except Exception as exc:  # noqa: BLE001 - this request fails, saying why
            return failed_output(latest, exc, f"{self.degraded_reason}, and it could not resume here")
        self._deferred["prefill"].append(("add", request_id, state))
        self._local[request_id] = pending
        return None
