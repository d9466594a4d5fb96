"""DPEngine: data_parallel_size replicas driven by one process, behind LLMEngine's interface.

Each replica is a whole LLMEngine (its own scheduler, request table, KV cache and compiled steps) on
its own device group: row r of the (data, model) device grid, a (1, tp) mesh (engine/step/mesh.py),
so TP runs inside each replica. The model is loaded once into host memory and each replica places
its own shards. What happens:

1. `add_request` tokenizes the prompt, asks the router (router.py: prefix affinity, then
   least outstanding tokens) for a replica, and hands the request to that replica's engine; the
   request's replica is remembered until it finishes (aborts go to the same place).
2. `step()` steps every replica that has work, each on its own thread: JAX releases the GIL while
   a replica's step runs on its devices, so the replicas' device work overlaps (the Python
   scheduling of each stays single-threaded per replica, as LLMEngine requires). The outputs are
   concatenated; finished requests come off the router's load.
3. `get_stats()` sums the replicas' counters into one EngineStats whose `replicas` holds each
   replica's own (the /metrics endpoint labels them `replica="r"`) and `router` the routing counts.

AsyncLLMEngine, LLM and the server take a DPEngine wherever they take an LLMEngine
(`make_engine(config)` picks one); the engine stays single-threaded from its caller's side.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from engine.config import EngineConfig
from engine.core.llm_engine import EngineDeadError, EngineStats, LLMEngine
from engine.errors import ParamError
from engine.sampling_params import SamplingParams
from engine.scaleout.router import PrefixAffinityRouter

# Summed over replicas in the aggregate EngineStats; everything else is taken from replica 0 or
# recomputed (kv_cache_usage, padded_token_fraction: averages).
_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
           "num_prompt_tokens", "num_generation_tokens", "num_steps", "num_free_blocks",
           "num_cached_blocks", "num_failed_steps", "num_constrained_requests", "num_grammars_compiled",
           "grammar_compile_seconds", "mask_fill_seconds", "num_mask_steps", "num_sliding_used_blocks")


def make_engine(config: EngineConfig, *, progress: bool = True):
    """An LLMEngine, a DPEngine when data_parallel_size > 1, or a PDEngine
    (engine/disaggregation/pd_engine.py) with disaggregation. Multi-host (num_processes > 1): every
    process joins the mesh and builds the same engine; process 0 gets it back (its steps are
    published to the others), any other process follows process 0's steps here and exits when the
    leader stops (multihost.py)."""
    if config.num_processes > 1:
        from engine.scaleout import multihost

        return multihost.engine_for_process(config, progress=progress)
    if config.disaggregation is not None:
        from engine.disaggregation.pd_engine import PDEngine

        return PDEngine(config, progress=progress)
    if config.data_parallel_size > 1:
        return DPEngine(config, progress=progress)
    return LLMEngine(config, progress=progress)


class DPEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True, devices=None, loaded=None):
        from engine.core.builder import load_for_mesh
        from engine.step.mesh import replica_meshes

        meshes = replica_meshes(config.tensor_parallel_size, config.data_parallel_size, devices)
        loaded = loaded or load_for_mesh(config, progress=progress)
        replica_config = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [LLMEngine(replica_config, progress=progress, mesh=mesh, loaded=loaded)
                         for mesh in meshes]
        self.config = config
        first = self.replicas[0]
        for name in ("tokenizer", "max_model_len", "model_name", "model_config", "dtype",
                     "attention_backend", "load_seconds"):
            setattr(self, name, getattr(first, name))
        self.compile_seconds = sum(r.compile_seconds for r in self.replicas)
        self.router = PrefixAffinityRouter(
            len(self.replicas), block_size=config.block_size,
            capacity_blocks=first.scheduler.config.num_blocks)
        self._owner: dict[str, tuple[int, int]] = {}  # request_id -> (replica, router cost)
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas), thread_name_prefix="replica")

    # -- what LLMEngine offers -----------------------------------------------------------------

    @property
    def runner(self):
        return self.replicas[0].runner  # sample_vocab_size and the like: the same in every replica

    @property
    def dead_reason(self) -> str | None:
        reasons = [f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.dead_reason]
        return "; ".join(reasons) or None

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return self.replicas[0].tokenize(prompt, add_special_tokens)

    @property
    def grammar_compiler(self):
        return self.replicas[0].grammar_compiler

    def compile_grammar(self, structured_outputs):
        return self.replicas[0].compile_grammar(structured_outputs)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                    *, add_special_tokens: bool = True, **kwargs) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        if request_id in self._owner:
            raise ParamError("request_id", f"request_id: {request_id!r} is already running")
        params = params or SamplingParams()
        ids = self.tokenize(prompt, add_special_tokens) if isinstance(params, SamplingParams) else []
        cost = (len(ids) + (params.max_tokens or self.max_model_len - len(ids))) * getattr(params, "n", 1)
        replica = self.router.route(ids, cost)
        try:
            # The ids go in (tokenized once); the text stays the prompt the outputs report.
            self.replicas[replica].add_request(
                request_id, ids or prompt, params, arrival_time, add_special_tokens=add_special_tokens,
                prompt_text=kwargs.pop("prompt_text", prompt if isinstance(prompt, str) else None), **kwargs)
        except Exception:
            self.router.finish(replica, cost)
            raise
        self._owner[request_id] = (replica, cost)

    def abort_request(self, request_id: str) -> bool:
        owner = self._owner.pop(request_id, None)
        if owner is None:
            return False
        self.router.finish(*owner)
        return self.replicas[owner[0]].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def warm_up_next(self) -> bool:  # one warm-up step (of the first replica with a cold bucket)
        return any(r.warm_up_next() for r in self.replicas)

    def warm_up_pending(self) -> bool:
        return any(r.warm_up_pending() for r in self.replicas)

    def step(self):
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) <= 1:
            results = [r.step() for r in busy]
        else:
            results = list(self._pool.map(lambda r: r.step(), busy))
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished and out.request_id in self._owner:
                self.router.finish(*self._owner.pop(out.request_id))
        return outputs

    def reconfigure_scheduler(self, **changes):
        schedulers = [r.reconfigure_scheduler(**changes) for r in self.replicas]
        self.config = dataclasses.replace(self.config, **changes)
        return schedulers

    def replica_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return None if owner is None else owner[0]

    def get_stats(self) -> EngineStats:
        per = [r.get_stats() for r in self.replicas]
        total = {name: sum(getattr(s, name) for s in per) for name in _SUMMED}
        return dataclasses.replace(
            per[0], **total,
            kv_cache_usage=sum(s.kv_cache_usage for s in per) / len(per),
            padded_token_fraction=sum(s.padded_token_fraction for s in per) / len(per),
            weight_bytes_per_device=tuple(b for s in per for b in s.weight_bytes_per_device),
            kv_cache_bytes_per_device=tuple(b for s in per for b in s.kv_cache_bytes_per_device),
            spec_decode=None, replicas=tuple(per), router=self.router.stats())
