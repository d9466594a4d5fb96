"""PDEngine: prefill/decode disaggregation over two device pools, behind LLMEngine's interface.

`EngineConfig(disaggregation="prefill:2,decode:2")`: the first devices form the prefill pool,
the next ones the decode pool (or, with `decode_address`, another process's devices:
decode_pool.py), each a (1, n) mesh with tensor parallelism inside it and its own
LLMEngine (scheduler, request table, compiled steps, paged KV cache). The model is loaded once
into host memory; each pool places its own shards. A request's life:

1. `add_request` tokenizes and hands the request to the prefill engine asking for one token: its
   scheduler runs the prompt (chunked, with prefix caching) and samples the first token, which
   is returned at once (finish_reason None), so the client's stream starts before the KV moves.
2. When the prefill engine finishes it, the prompt's full blocks are found in the prefill pool's
   prefix cache by their hashes (cached before the request was freed; nothing allocated since),
   gathered (kv_transfer.py, block counts padded to buckets) and sent with
   `jax.device_put` onto the decode cache's sharding, all without waiting.
3. When the decode pool is idle, its KVCacheManager.import_blocks registers blocks under the same
   hashes (keeping any it holds already) and pins them, the new ones are scattered into its
   donated cache, and the decode engine gets the request with `resume` (each sequence starts
   with its first token, logprobs, stop-string and grammar state, and the same seed). Its
   scheduler admits it as a prefix hit on every full prompt block and computes the partial last
   block (fewer than block_size tokens) with the first token. The pins go once it is admitted;
   the prefill pool's blocks stay there as its prefix cache. A decode pool in another process
   does the same on its own between its steps (decode_pool.py): the handover is a
   message, and this process never waits for that pool's step to take it.

`step()` keeps one step of each pool in flight on its own thread and returns the outputs of the
first to finish, so decode streams keep their pace while a prefill step runs. Backpressure: at
`max_pending_transfers` requests gathered or pinned, the prefill pool pauses. Aborts reach the
request wherever it is (prefill queue or step, waiting to move, pinned, decoding) and leave no
block held; for a pool whose step is in flight they are queued and applied when it ends, so
the caller never waits for a long prefill step. A decode-side
preemption recomputes there (the moved blocks are likely still its prefix cache).

Degraded mode (the decode pool lost: the prefill engine decodes everything itself): pd_degraded.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time

import jax

from engine.config import EngineConfig
from engine.core.engine_stats import EngineDeadError, EngineStats
from engine.core.llm_engine import LLMEngine
from engine.disaggregation import pd_stats
from engine.disaggregation.local_pool import DecodePool, failed_output
from engine.disaggregation.pd_degraded import Decoding, DegradedMode, Pending
from engine.disaggregation.pd_handover import Handover
from engine.disaggregation.pd_stats import transfer_stats
from engine.errors import ParamError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

POOLS = pd_stats.POOLS


class PDEngine(Handover, DegradedMode):
    def __init__(self, config: EngineConfig, *, progress: bool = True, devices=None, loaded=None):
        from engine.core.builder import load_for_mesh
        from engine.disaggregation.decode_pool import RemoteDecodePool
        from engine.disaggregation.kv_transfer import (
            KVGather,
            KVScatter,
            TransferClock,
            block_buckets,
        )
        from engine.step.mesh import replica_meshes

        pd = config.disaggregation
        devices = list(jax.devices() if devices is None else devices)
        local = pd.prefill if pd.decode_address is not None else pd.num_devices  # devices of this process
        if local > len(devices):
            raise ValueError(f"EngineConfig.disaggregation: prefill:{pd.prefill},decode:{pd.decode} needs "
                             f"{local} devices here, but only {len(devices)} are present; on the CPU set "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported")
        # One cache group per pool: imported blocks carry every layer (no sliding-window accounting).
        pool_config = dataclasses.replace(config, disaggregation=None, tensor_parallel_size=pd.prefill,
                                          disable_hybrid_kv_cache_manager=True)
        loaded = loaded or load_for_mesh(pool_config, progress=progress)
        blocks = (pd.prefill_num_kv_blocks, pd.decode_num_kv_blocks)
        for name, n in zip(POOLS, blocks):
            if n is not None and config.max_model_len is not None and (n - 1) * config.block_size < config.max_model_len:
                raise ValueError(f"EngineConfig.disaggregation.{name}_num_kv_blocks={n} holds {n - 1} blocks of "
                                 f"{config.block_size} tokens, less than one request of max_model_len="
                                 f"{config.max_model_len}: the {name} pool could never take such a prompt")
        prefill_mesh = replica_meshes(pd.prefill, 1, devices[: pd.prefill])[0]
        self.prefill = LLMEngine(dataclasses.replace(pool_config, num_kv_blocks=blocks[0] or config.num_kv_blocks),
                                 progress=progress, mesh=prefill_mesh, loaded=loaded)
        buckets = block_buckets(self.prefill.runner.shapes.max_blocks_per_seq)
        self.gather = KVGather(self.prefill.runner, buckets)
        decode_config = dataclasses.replace(pool_config, num_kv_blocks=blocks[1] or config.num_kv_blocks,
                                            tensor_parallel_size=pd.decode)
        if pd.decode_address is not None:
            self.decode = RemoteDecodePool(pd.decode_address, decode_config, buckets, self.prefill.runner)
        else:
            decode_mesh = replica_meshes(pd.decode, 1, devices[pd.prefill : pd.num_devices])[0]
            engine = LLMEngine(decode_config, progress=progress, mesh=decode_mesh, loaded=loaded)
            self.decode = DecodePool(engine, KVScatter(engine.runner, buckets))
        self.config = config
        for name in ("tokenizer", "max_model_len", "model_name", "model_config", "dtype",
                     "attention_backend", "load_seconds"):
            setattr(self, name, getattr(self.prefill, name))
        self.clock = TransferClock()
        self.compile_seconds = self.prefill.compile_seconds + getattr(
            getattr(self.decode, "engine", None), "compile_seconds", 0.0)
        self.block_size = config.block_size
        self.max_pending = pd.max_pending_transfers
        self._prefilling: dict[str, Pending] = {}
        self._ready: collections.OrderedDict[str, tuple] = collections.OrderedDict()  # prefilled, queued to move
        self._decoding: dict[str, Decoding] = {}  # handed to the decode pool
        self._local: dict[str, Pending] = {}  # degraded mode: decoded by the prefill engine itself
        self.degraded_reason: str | None = None  # why the decode pool is lost (see the module docstring)
        self._lost_stats: EngineStats | None = None  # the lost decode pool's last stats, gauges zeroed
        self._failed: list[RequestOutput] = []  # requests that could not resume here, for the next step
        self._seed = config.seed * 1_000_003
        self._seed_counter = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pool")
        self._running: dict[str, concurrent.futures.Future | None] = dict.fromkeys(POOLS)
        self._locks = {name: threading.Lock() for name in POOLS}
        self._deferred: dict[str, list] = {name: [] for name in POOLS}  # adds and aborts for a busy pool

    # -- what LLMEngine offers -----------------------------------------------------------------

    @property
    def runner(self):
        return self.prefill.runner  # sample_vocab_size and the like: the same in both pools

    @property
    def dead_reason(self) -> str | None:
        """Only the prefill pool's death ends the engine; the decode pool's degrades it."""
        reason = self.prefill.dead_reason
        return None if reason is None else f"prefill pool: {reason}"

    @property
    def engines(self) -> tuple:
        return self.prefill, self.decode

    @property
    def grammar_compiler(self):
        return self.prefill.grammar_compiler

    def compile_grammar(self, structured_outputs):
        return self.prefill.compile_grammar(structured_outputs)

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return self.prefill.tokenize(prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                    *, add_special_tokens: bool = True, **kwargs) -> None:
        """Tokenizes and hands the request to the prefill engine (asking for its first token; in
        degraded mode for all of them): its scheduler queues it. Every prompt that fits
        max_model_len fits both pools (each pool's cache holds a max_model_len request:
        SchedulerConfig's check, named at start-up)."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        if any(request_id in d for d in (self._prefilling, self._ready, self._decoding, self._local)):
            raise ParamError("request_id", f"request_id: {request_id!r} is already running")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt, add_special_tokens)
        kwargs.setdefault("prompt_text", prompt if isinstance(prompt, str) else None)
        room = self.max_model_len - len(ids)
        base_seed = params.seed if params.seed is not None else self._seed + next(self._seed_counter)
        pending = Pending(ids, params, time.monotonic() if arrival_time is None else arrival_time, kwargs,
                           base_seed, room if params.max_tokens is None else min(params.max_tokens, room))
        # Validated now (bad input raises here); queued into the prefill scheduler when the pool
        # is between steps, so a long prefill step in flight never blocks the caller.
        local = self.degraded_reason is not None
        state = self.prefill.prepare_request(request_id, ids, params if local else dataclasses.replace(
            params, max_tokens=1), pending.arrival, base_seed=base_seed, **kwargs)
        self._deferred["prefill"].append(("add", request_id, state))
        (self._local if local else self._prefilling)[request_id] = pending

    def abort_request(self, request_id: str) -> bool:
        """Wherever the request is. In a pool that is stepping, the abort happens as soon as
        the step ends; its outputs are dropped from now on."""
        if self._ready.pop(request_id, None) is not None:
            return True  # its blocks stay in the prefill pool's cache
        if self._prefilling.pop(request_id, None) is not None or self._local.pop(request_id, None) is not None:
            self._deferred["prefill"].append(("abort", request_id, None))
        elif self._decoding.pop(request_id, None) is not None:
            self._deferred["decode"].append(("abort", request_id, None))
        else:
            return False
        self._apply_deferred()
        return True

    def _apply_deferred(self) -> list[RequestOutput]:
        """The queued adds and aborts of every pool that is between steps; failed outputs."""
        failed = []
        for name, pool in zip(POOLS, self.engines):
            if self._running[name] is not None:
                continue
            with self._locks[name]:
                queued, self._deferred[name] = self._deferred[name], []
                if name == "decode" and self.degraded_reason is not None:
                    continue  # the pool is lost: nothing more goes to it
                for op, request_id, state in queued:
                    try:
                        if op == "abort":
                            pool.abort_request(request_id)
                        else:
                            pool.submit(state)
                    except EngineDeadError as exc:
                        if name == "prefill":
                            raise
                        self._degrade(exc)  # the decode pool is lost
                        break
                    except Exception as exc:  # this request fails; the pools serve on
                        if self._prefilling.pop(request_id, None) is not None or self._local.pop(
                                request_id, None) is not None:
                            failed.append(failed_output(state.output(), exc, "the prefill pool refused it"))
        return failed

    def has_unfinished_requests(self) -> bool:
        """Also True while a pool's step is in flight: its outputs are still to come."""
        return bool(self._prefilling or self._ready or self._decoding or self._local or any(
            self._deferred.values())) or any(f is not None for f in self._running.values()) or (
            self.degraded_reason is None and self.decode.has_unfinished_requests())

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs the pools independently: each pool with work steps on its own thread, and this
        call returns the outputs of the first step to finish (the other pool may still be
        stepping). So decoding streams keep their pace while a prefill step runs, and the other
        way round. Handovers: a finished prefill's blocks are gathered at once (the prefill pool
        is idle then); they land in the decode pool when it is idle. Backpressure: at
        max_pending_transfers requests gathered or moved and not yet admitted by the decode
        scheduler, the prefill pool pauses (its requests wait in its queue). A lost decode pool
        degrades the engine (the module docstring) instead of failing the step."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        if self.degraded_reason is None and self._running["decode"] is None and self.decode.dead_reason:
            self._degrade(EngineDeadError(self.decode.dead_reason))
        outputs = self._land_handovers()
        outputs += self._launch()
        running = [f for f in self._running.values() if f is not None]
        if running:
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        outputs += self._collect()
        outputs += self._land_handovers()
        outputs += self._launch()
        outputs += self._failed
        self._failed = []
        return outputs

    def _launch(self) -> list[RequestOutput]:
        failed = self._apply_deferred()
        degraded = self.degraded_reason is not None
        paused = not degraded and len(self._ready) + self.decode.num_pending >= self.max_pending
        for name, pool in zip(POOLS, self.engines):
            if name == "decode" and degraded:
                continue
            if self._running[name] is None and pool.has_unfinished_requests() and not (name == "prefill" and paused):
                self._running[name] = self._pool.submit(self._locked_step, name)
        return failed

    def _locked_step(self, name: str):
        with self._locks[name]:
            return self.engines[POOLS.index(name)].step()

    def _collect(self) -> list[RequestOutput]:
        outputs = []
        for name in POOLS:
            future = self._running[name]
            if future is None or not future.done():
                continue
            self._running[name] = None
            if name == "prefill":
                results = future.result()  # a prefill step failing here is the engine's error
                outputs += filter(None, (self._after_prefill(out) for out in results))
                continue
            try:
                results = future.result()
            except Exception as exc:  # the decode pool is lost (a request's failure is an output)
                self._degrade(exc)
                continue
            for out in results:
                decoding = self._decoding.get(out.request_id)
                if decoding is None:
                    continue  # aborted while its last step ran
                decoding.latest = out
                if out.finished:
                    del self._decoding[out.request_id]
                outputs.append(out)
            if self.decode.dead_reason is not None:  # its engine died in that step
                self._degrade(EngineDeadError(self.decode.dead_reason))
        return outputs

    def _after_prefill(self, out: RequestOutput) -> RequestOutput | None:
        if out.request_id in self._local:
            if out.finished:
                del self._local[out.request_id]
            return out
        pending = self._prefilling.get(out.request_id)
        if pending is None:
            return None  # aborted while its last prefill step ran
        goes_on = pending.max_tokens > 1
        firsts = [dataclasses.replace(c, finish_reason=None) if goes_on and c.finish_reason == "length" else c
                  for c in out.outputs]
        shown = dataclasses.replace(out, outputs=firsts, finished=all(c.finish_reason for c in firsts))
        if not out.finished:
            return shown  # n > 1: some samples still prefilling
        del self._prefilling[out.request_id]
        if shown.finished:
            return out  # every sample ended at its first token (a stop, EOS, or max_tokens 1)
        if self.degraded_reason is not None:
            first_time = out.metrics.first_token_time or time.monotonic()
            return self._resume_here(out.request_id, pending, shown, out.prompt_logprobs, first_time) or shown
        try:
            self._ready[out.request_id] = (pending, out, firsts, *self._gather(pending.prompt_ids))
        except Exception as exc:  # this request fails; the pools serve on
            return failed_output(out, exc)
        return shown

    def wait_idle(self) -> None:
        """Waits for the pools' steps in flight (their outputs come with the next step())."""
        concurrent.futures.wait([f for f in self._running.values() if f is not None])

    # -- the rest of LLMEngine's interface -------------------------------------------------------

    def reconfigure_scheduler(self, **changes):
        self.wait_idle()
        self._collect()
        self._apply_deferred()
        if self._ready:
            raise ValueError("reconfigure_scheduler needs an idle engine: KV transfers are pending")
        engines = self.engines if self.degraded_reason is None else (self.prefill,)
        schedulers = [e.reconfigure_scheduler(**changes) for e in engines]
        self.config = dataclasses.replace(self.config, **changes)
        return schedulers

    def pool_of(self, request_id: str) -> str | None:
        """Where a request is now: "prefill" (queued or running there), "transfer" (prefilled and
        waiting to move, or moved and not yet admitted), "decode", or "local" (degraded mode:
        the prefill engine decodes it)."""
        if request_id in self._prefilling:
            return "prefill"
        if request_id in self._local:
            return "local"
        if request_id in self._ready:
            return "transfer"
        if request_id not in self._decoding:
            return None
        return "transfer" if self.decode.is_pinned(request_id) else "decode"

    def get_stats(self) -> EngineStats:
        decode = self._lost_stats
        if self.degraded_reason is None:
            try:
                decode = self.decode.get_stats()
            except EngineDeadError as exc:  # (a call only before its first step)
                self._degrade(exc)
                decode = self._lost_stats
        return pd_stats.aggregate(self.prefill.get_stats(), decode, transfer_stats(self.clock, self.decode),
                                  num_pending_transfers=0 if self.degraded_reason else self.decode.num_pending,
                                  degraded_reason=self.degraded_reason)
