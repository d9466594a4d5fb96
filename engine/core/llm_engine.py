"""LLMEngine: requests in, tokens out, one scheduler step at a time.

A step, in order (DESIGN.md section 2):
1. `Scheduler.schedule()` decides who runs and with how many tokens (running requests first,
   then waiting ones, within the token budget), allocating KV blocks, and lists who joined or left.
2. `ModelRunner.execute()` updates its request table from that list, runs one compiled step over
   the whole mixed batch and returns, per request that sampled, its tokens and typed logprobs.
3. `Scheduler.update()` appends those tokens, finishes requests (EOS, stop token, max_tokens,
   max_model_len) and frees their blocks.
4. The engine detokenizes incrementally, applies stop strings (finishing the request through the
   scheduler), and returns a RequestOutput for every request that advanced.

A step is all-or-nothing: if the runner raises, the step is discarded in the scheduler and the
requests it carried fail with the error (RequestOutput.error); a runner whose device state was
lost marks the engine dead (`dead_reason`), and later calls raise EngineDeadError. A failure while
detokenizing fails only that request.

A request with n > 1 runs as n scheduler requests ("<id>#<i>") that share the prompt; they meet
again in one RequestOutput. The engine is single-threaded: the async server drives it from one
thread. `LLMEngine(config)` builds its own parts (builder.py); `LLMEngine.from_parts`
takes a scheduler, a runner and a tokenizer made elsewhere (a fake runner in tests).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

from engine.config import EngineConfig
from engine.core.builder import EngineParts, build_parts, scheduler_config_for
from engine.core.engine_stats import EngineDeadError, EngineStats
from engine.core.request_state import RequestState, Resume, SequenceState, prompt_ids
from engine.core.sequences import add_sequences
from engine.errors import ParamError
from engine.lora.manager import request_adapter
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.base import make_spec_decoder
from engine.step.kv_cache import every_layer_slides
from engine.step.logit_controls import build_logit_controls
from engine.step.model_runner import num_backend_compilations
from engine.step.placement import device_bytes
from scheduler import FinishReason, Scheduler

# Knobs that change only the scheduler (no compiled shape): reconfigure_scheduler() takes these.
SCHEDULER_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "enable_prefix_caching",
                   "enable_chunked_prefill", "policy", "kv_allocation", "max_request_share")


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True, mesh=None, loaded=None):
        """`mesh`: this engine's device group (engine/step/mesh.py; None: from
        tensor_parallel_size); `loaded`: a models.loader.LoadedModel to use instead of loading
        config.model."""
        if config.data_parallel_size > 1 and mesh is None:
            raise ValueError(f"EngineConfig.data_parallel_size={config.data_parallel_size}: one LLMEngine "
                             "is one replica; build engine.scaleout.dp_engine.DPEngine (or make_engine) instead")
        self._setup(build_parts(config, progress=progress, mesh=mesh, loaded=loaded))

    @classmethod
    def from_parts(cls, config: EngineConfig, *, scheduler: Scheduler, runner, tokenizer,
                   model_name: str = "custom", proposer=None, lora_manager=None) -> LLMEngine:
        """An engine over parts built elsewhere; `runner` needs `execute(scheduler_output)` and
        `sample_vocab_size` (the ids a prompt may hold); `proposer` overrides the one
        speculative_config would build (engine/spec_decode/base.py); `lora_manager` serves the
        adapters of a runner built with LoRA slots (engine/lora/manager.py)."""
        engine = cls.__new__(cls)
        engine._setup(EngineParts(config=config, scheduler=scheduler, runner=runner,
                                  tokenizer=tokenizer, max_model_len=scheduler.config.max_model_len,
                                  model_name=model_name, proposer=proposer, lora_manager=lora_manager))
        return engine

    def _setup(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.model_name = parts.model_name
        self.model_config = parts.model_config
        self.dtype = parts.dtype
        self.attention_backend = parts.attention_backend
        self.load_seconds = parts.load_seconds
        self.compile_seconds = parts.compile_seconds
        self.placement = parts.placement
        self.lora_manager = parts.lora_manager  # engine/lora/manager.py; None without enable_lora
        self._device_bytes = device_bytes(parts.runner, parts.placement)
        self.dead_reason: str | None = None
        self._num_blocks = parts.scheduler.config.num_blocks  # the cache the runner allocated
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._seed_counter = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_failed_steps = 0
        # Speculative decoding (engine/spec_decode/): drafts before schedule(), counts after update().
        self.spec = make_spec_decoder(self.config.speculative_config, self.runner,
                                      max_num_batched_tokens=self.config.max_num_batched_tokens,
                                      proposer=parts.proposer)
        self._grammar_compiler = None
        self._compiler_lock = threading.Lock()
        self._num_constrained_requests = 0

    def reconfigure_scheduler(self, **changes) -> Scheduler:
        """A new scheduler with changed knobs (SCHEDULER_KNOBS, EngineConfig's names), over the
        same compiled runner; only while no request is in flight. `config` follows the change."""
        unknown = sorted(set(changes) - set(SCHEDULER_KNOBS))
        if unknown:
            raise ValueError(f"reconfigure_scheduler: {', '.join(unknown)} cannot change after start-up "
                             f"(scheduler knobs: {', '.join(SCHEDULER_KNOBS)})")
        if self.has_unfinished_requests() or self.scheduler.has_unfinished_requests():
            raise ValueError("reconfigure_scheduler needs an idle engine: requests are in flight; finish or abort them first")
        config = dataclasses.replace(self.config, **changes)
        shapes = getattr(self.runner, "shapes", None)
        old = self.scheduler.config  # the runner's cache groups stay: so does the sliding group
        num_blocks, num_sliding = config.num_kv_blocks or self._num_blocks, old.num_sliding_blocks
        cache, limit = num_blocks, "num_blocks"  # the cache's blocks, and what the runner allocated
        if every_layer_slides(self.model_config, num_sliding):
            # num_kv_blocks is the sliding pool (the cache); the global pool holds no memory and
            # keeps its size.
            num_blocks, num_sliding = old.num_blocks, config.num_kv_blocks or num_sliding
            cache, limit = num_sliding, "num_sliding_blocks"
        if shapes is not None:
            if cache > getattr(shapes, limit):
                raise ValueError(f"reconfigure_scheduler: num_kv_blocks={cache} exceeds the "
                                 f"allocated cache ({getattr(shapes, limit)} blocks)")
            if config.max_num_batched_tokens > shapes.token_buckets[-1]:
                raise ValueError(f"reconfigure_scheduler: max_num_batched_tokens="
                                 f"{config.max_num_batched_tokens} exceeds the largest compiled "
                                 f"token bucket ({shapes.token_buckets[-1]})")
            if config.max_num_seqs > shapes.max_num_seqs:
                raise ValueError(f"reconfigure_scheduler: max_num_seqs={config.max_num_seqs} exceeds "
                                 f"the largest compiled sequence bucket ({shapes.max_num_seqs})")
        if self.spec is not None:
            self.spec.set_token_budget(config.max_num_batched_tokens)
        # The old scheduler's last finishes reach the runner's table (and a draft model's) with
        # one empty step.
        out = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.after_schedule(out, self.scheduler)
        self.runner.execute(out)
        self.scheduler = Scheduler(scheduler_config_for(config, max_model_len=self.max_model_len,
                                                        num_blocks=num_blocks, sliding_window=old.sliding_window,
                                                        num_sliding_blocks=num_sliding))
        self.config = config
        return self.scheduler

    # -- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, validated; ValueError naming `prompt` otherwise."""
        return prompt_ids(prompt, self.tokenizer, self.runner.sample_vocab_size, self.max_model_len,
                          add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, **kwargs) -> None:
        """Queues a request: `prepare_request` (whose keywords these are), then `submit`."""
        self.submit(self.prepare_request(request_id, prompt, params, arrival_time, **kwargs))

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        arrival_time: float | None = None, *, add_special_tokens: bool = True,
                        priority: int = 0, prompt_text: str | None = None,
                        group_id: str | None = None, grammar=None, base_seed: int | None = None,
                        resume: Resume | None = None, lora_request=None) -> RequestState:
        """Validates a request and builds its state without touching the scheduler (so while another
        thread steps this engine: engine/disaggregation/pd_engine.py); `submit` queues it.
        `group_id` ties the prompts of one client request together for the fairness cap
        (EngineConfig.max_request_share); by default the request is its own group. `grammar`:
        params.structured_outputs already compiled (compile_grammar, on another thread); without it
        a constrained request is compiled here (the LRU makes a repeat free). `base_seed`: the
        sampling seed of an unseeded request (default: the engine's counter). `resume`: the prompt
        ran elsewhere (the prefill pool, engine/disaggregation/pd_engine.py): each sequence starts
        with its first token, and the prompt's KV is expected in the prefix cache; or with every
        token a lost decode pool had made, recomputed here (PDEngine's degraded mode). `lora_request`:
        the LoRA adapter to run with (an engine.LoRARequest, the name of a loaded adapter, or a
        LoadedAdapter its manager resolved on another thread); None: the base model."""
        self._check_alive()
        adapter = request_adapter(self.lora_manager, lora_request)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ParamError("request_id", "request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ParamError("request_id", f"request_id: {request_id!r} is already running")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ParamError(name, f"{name}: at most {self.config.max_logprobs}, got {value}")
        ids = self.tokenize(prompt, add_special_tokens)
        if params.prompt_logprobs is not None and not self.scheduler.config.enable_chunked_prefill and (
                len(ids) > (self.scheduler.config.max_num_logits or len(ids))):
            raise ParamError("prompt_logprobs", f"prompt_logprobs: a prompt of {len(ids)} tokens is scored "
                             f"{self.scheduler.config.max_num_logits} positions per step, which needs "
                             "chunked prefill (enable_chunked_prefill=True)")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params.structured_outputs)
        bias, bad_sequences = build_logit_controls(params, self.tokenizer, self.runner.sample_vocab_size)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt_text if prompt_text is not None else
                             (prompt if isinstance(prompt, str) else None), ids, params,
                             RequestMetrics(arrival_time=arrival),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        if base_seed is None:
            base_seed = params.seed if params.seed is not None else (
                self.config.seed * 1_000_003 + next(self._seed_counter))
        add_sequences(state, max_tokens, arrival, base_seed=base_seed, priority=priority,
                      group_id=group_id or request_id, grammar=grammar, bias=bias,
                      bad_sequences=bad_sequences, adapter=adapter, resumed=resume is not None,
                      tokenizer=self.tokenizer, sample_vocab_size=self.runner.sample_vocab_size)
        if resume is not None:
            state.prompt_logprobs = resume.prompt_logprobs
            for seq, first in zip(state.seqs, resume.first, strict=True):
                if seq.resume_from(first, resume.first_token_time) is None:
                    self._advance_mask_state(seq, list(first.token_ids), {})
        return state

    def submit(self, state: RequestState) -> None:
        """Queues a prepared request (only between steps)."""
        if state.request_id in self._requests:
            raise ParamError("request_id", f"request_id: {state.request_id!r} is already running")
        for seq in state.seqs:  # validated as a whole before any of it reaches the scheduler
            if seq.finish_reason is None:
                self.scheduler.add_request(seq.request)
                self._seqs[seq.seq_id] = seq
        self._requests[state.request_id] = state
        self._num_prompt_tokens += len(state.prompt_token_ids)
        self._num_constrained_requests += state.params.structured_outputs is not None

    @property
    def grammar_compiler(self):
        """The engine's GrammarCompiler (built on first use; any thread may call it)."""
        with self._compiler_lock:
            if self._grammar_compiler is None:
                from engine.structured_output.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.sample_vocab_size)
            return self._grammar_compiler

    def compile_grammar(self, structured_outputs):
        """StructuredOutputsParams -> CompiledGrammar; thread-safe, ParamError naming the field."""
        return self.grammar_compiler.compile(structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            self.scheduler.abort_request(seq.seq_id)
            self._seqs.pop(seq.seq_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def warm_up_next(self) -> bool:
        """For idle moments (AsyncLLMEngine): runs one compiled bucket that has not run yet once on
        an all-padding step (ModelRunner.warm_up_next; with EngineConfig.warmup, for the buckets
        compiled in the background). True if it ran one."""
        if self.dead_reason is not None or self._requests:
            return False
        warm = getattr(self.runner, "warm_up_next", None)
        return bool(warm and warm())

    def warm_up_pending(self) -> bool:
        """Whether warm_up_next has, or will have once the background compilation publishes
        more buckets, one to run."""
        pending = getattr(self.runner, "warm_up_pending", None)
        return self.dead_reason is None and bool(pending and pending())

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        if self.spec is not None:
            self.spec.prepare(self.scheduler)  # drafts into Request.spec_token_ids
        out = self.scheduler.schedule()
        try:
            if self.spec is not None:
                self.spec.after_schedule(out, self.scheduler)  # a draft model drafts now
            result = self.runner.execute(out)  # also tells the runner's table who joined or left
            # update() validates the whole result before it changes anything.
            finished = {r.req_id: r for r in self.scheduler.update(out, result)}
        except Exception as exc:  # all-or-nothing: the step is dropped, its requests fail
            return self._fail_step(out, exc)
        if self.spec is not None:
            self.spec.observe(out, result)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for seq_id, (start, entries) in (result.prompt_logprobs or {}).items():
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.parent.add_prompt_logprobs(start, entries)
        logprobs = result.logprobs or [None] * len(result.req_ids)
        for seq_id, lps in zip(result.req_ids, logprobs):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            kept = seq.request.output_token_ids[seq.num_tokens_seen :]  # update() may cut at a stop
            self._num_generation_tokens += len(kept)
            try:
                stopped = seq.append(kept, lps, now)
            except Exception as exc:  # a detokenizer or stop-check fault fails this request only
                self.scheduler.abort_request(seq_id)
                seq.error = f"{type(exc).__name__}: {exc}"
                finished[seq_id] = seq.request
                stopped = False
            if not stopped and seq_id not in finished and seq.row.constrained:
                stopped = self._advance_mask_state(seq, kept, finished)
            if stopped and seq_id not in finished:
                self.scheduler.finish_request(seq_id, FinishReason.STOP)
                finished[seq_id] = seq.request
            touched[seq.parent.request_id] = seq.parent
        for seq_id, req in finished.items():
            self._finish_seq(seq_id, str(req.finish_reason or FinishReason.STOP), now, touched)
        return self._collect(touched)

    def _advance_mask_state(self, seq, kept: list[int], finished: dict) -> bool:
        """Feeds the kept tokens to the sequence's grammar / bad-word state; True when the
        grammar is complete (the sequence stops). A rejected token fails the sequence."""
        row = seq.row
        if row.banned is not None:
            row.banned.accept(kept)
        grammar = row.grammar
        if grammar is None:
            return False
        if not grammar.accept(kept):
            self.scheduler.abort_request(seq.seq_id)
            seq.error = f"structured output: the grammar rejected a sampled token: {grammar.error}"
            finished[seq.seq_id] = seq.request
            return False
        return grammar.finished

    def _fail_step(self, out, exc: Exception) -> list[RequestOutput]:
        self.scheduler.discard_step(out)
        self._num_failed_steps += 1
        if not getattr(self.runner, "healthy", True):
            self.dead_reason = f"the runner lost its device state in a step: {type(exc).__name__}: {exc}"
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for sr in out.scheduled:
            seq = self._seqs.get(sr.req_id)
            if seq is not None:
                self.scheduler.abort_request(sr.req_id)
                seq.error = f"the step failed: {type(exc).__name__}: {exc}"
                self._finish_seq(sr.req_id, "abort", now, touched)
        return self._collect(touched)

    def _finish_seq(self, seq_id: str, reason: str, now: float, touched: dict) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            seq.finish(reason, now)
            touched[seq.parent.request_id] = seq.parent

    def _collect(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = []
        for state in touched.values():
            outputs.append(state.output())
            if state.finished:
                self._requests.pop(state.request_id, None)
        return outputs

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")

    # -- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats
        real = getattr(self.runner, "num_real_tokens", 0)
        padded = getattr(self.runner, "num_padded_tokens", 0)
        fed = real + padded
        compiler = self._grammar_compiler
        builder = getattr(self.runner, "builder", None)
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_compilations=num_backend_compilations(), num_steps=s.num_steps,
            num_free_blocks=s.num_free_blocks, num_cached_blocks=s.num_cached_blocks,
            padded_token_fraction=padded / fed if fed else 0.0, num_failed_steps=self._num_failed_steps,
            spec_decode=self.spec.stats() if self.spec is not None else None,
            num_constrained_requests=self._num_constrained_requests,
            num_grammars_compiled=compiler.stats.num_compiled if compiler else 0,
            grammar_compile_seconds=compiler.stats.compile_seconds if compiler else 0.0,
            mask_fill_seconds=getattr(builder, "mask_seconds", 0.0),
            num_mask_steps=getattr(builder, "num_mask_steps", 0),
            num_sliding_used_blocks=s.num_sliding_used_blocks,
            weight_bytes_per_device=self._device_bytes[0], kv_cache_bytes_per_device=self._device_bytes[1])


__all__ = ["CompletionOutput", "EngineDeadError", "EngineStats", "LLMEngine"]
