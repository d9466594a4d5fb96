"""LLMEngine: requests in, tokens out, one scheduler step at a time.

A step, in order (DESIGN.md section 2):
1. `Scheduler.schedule()` decides who runs and with how many tokens (running requests first,
   then waiting ones, within the token budget), allocating KV blocks.
2. `ModelRunner.execute()` runs one compiled step over the whole mixed batch and returns the
   sampled token of every request whose scheduled chunk reached its last known token.
3. `Scheduler.update()` appends those tokens, finishes requests (EOS, stop token, max_tokens,
   max_model_len) and frees their blocks.
4. The engine detokenizes incrementally, applies stop strings (finishing the request through the
   scheduler), and returns a RequestOutput for every request that advanced.

A request with n > 1 runs as n scheduler requests ("<id>#<i>") that share the prompt; they meet
again in one RequestOutput. The engine is single-threaded: the async server drives it from one
thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib

import jax

from engine.config import EngineConfig, resolve_dtype, resolve_seq_buckets, resolve_token_buckets
from engine.kv_cache import num_blocks_for
from engine.model_runner import ModelRunner, RunnerShapes, num_backend_compilations
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request_state import RequestState, SequenceState
from engine.sampling_params import SamplingParams
from engine.step_inputs import RowParams
from models.loader import load_model
from pallas_kernels import resolve_backend
from scheduler import FinishReason, Request, Scheduler, SchedulerConfig


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


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.config = config
        _enable_compilation_cache(config.compilation_cache_dir)
        platform = jax.devices()[0].platform
        self.dtype = resolve_dtype(config, platform)
        backend = resolve_backend(config.attention_backend, platform)
        start = time.perf_counter()
        loaded = load_model(config.model, dtype=self.dtype, seed=config.seed,
                            tokenizer=config.tokenizer, progress=progress,
                            cache_dir=config.weights_cache_dir)
        self.load_seconds = time.perf_counter() - start
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = _model_name(config.model, loaded.config.name)
        limit = loaded.config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(limit, 4096)
        if self.max_model_len > limit:
            raise ValueError(f"EngineConfig.max_model_len ({self.max_model_len}) exceeds the model's "
                             f"context length ({limit})")
        bs = config.block_size
        max_blocks_per_seq = -(-self.max_model_len // bs)
        num_blocks = num_blocks_for(
            loaded.config, block_size=bs, dtype=self.dtype, num_kv_blocks=config.num_kv_blocks,
            kv_cache_bytes=config.kv_cache_bytes, memory_fraction=config.kv_cache_memory_fraction,
            max_useful_blocks=config.max_num_seqs * max_blocks_per_seq + 1)
        if (num_blocks - 1) * bs < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks - 1} blocks of {bs} tokens) cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens: raise num_kv_blocks / kv_cache_bytes "
                "or lower max_model_len")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=bs, num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, policy=config.policy,
            kv_allocation=config.kv_allocation))
        self.shapes = RunnerShapes(
            token_buckets=resolve_token_buckets(config), seq_buckets=resolve_seq_buckets(config),
            max_blocks_per_seq=max_blocks_per_seq, num_blocks=num_blocks, block_size=bs,
            history_len=self.max_model_len, num_logprobs=config.max_logprobs,
            sample_vocab_size=min(loaded.config.vocab_size, loaded.tokenizer.vocab_size))
        start = time.perf_counter()
        self.runner = ModelRunner(loaded.config, loaded.params, self.shapes, dtype=self.dtype,
                                  attention_backend=backend, interpret=config.interpret,
                                  precompile=config.precompile, progress=progress)
        self.compile_seconds = time.perf_counter() - start
        self.attention_backend = backend
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._seed_counter = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # -- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, validated; ValueError naming `prompt` otherwise."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            vocab = self.shapes.sample_vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt: token id {t!r} is not an integer in [0, {vocab})")
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one generated token)")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, add_special_tokens: bool = True,
                    priority: int = 0, prompt_text: str | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs: at most {self.config.max_logprobs}, got {params.logprobs}")
        ids = self.tokenize(prompt, add_special_tokens)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt_text if prompt_text is not None else
                             (prompt if isinstance(prompt, str) else None), ids, params,
                             RequestMetrics(arrival_time=arrival))
        eos_ids = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        stop_ids = tuple(sorted(set(params.stop_token_ids) | eos_ids))
        base_seed = params.seed if params.seed is not None else (
            self.config.seed * 1_000_003 + next(self._seed_counter))
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = zlib.crc32(f"{base_seed}/{i}".encode())
            row = RowParams(params.temperature, params.top_k if params.top_k > 0 else 0, params.top_p,
                            params.min_p, params.presence_penalty, params.frequency_penalty,
                            params.repetition_penalty, seed, params.logprobs is not None)
            sched_req = Request(seq_id, ids, max_tokens, eos_token_id=None if params.ignore_eos
                                else self.tokenizer.eos_token_id, stop_token_ids=stop_ids,
                                ignore_eos=params.ignore_eos, priority=priority, arrival_time=arrival)
            seq = SequenceState(seq_id, i, state, sched_req, row, self.tokenizer)
            state.seqs.append(seq)
        for seq in state.seqs:  # validated as a whole before any of it reaches the scheduler
            self.scheduler.add_request(seq.request)
            self._seqs[seq.seq_id] = seq
        self._requests[request_id] = state
        self._num_prompt_tokens += len(ids)

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

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out, self._row_params, self._history)
        finished = {r.req_id: r for r in self.scheduler.update(out, result)}
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        extras = result.extras or {}
        for i, (seq_id, token) in enumerate(zip(result.req_ids, result.sampled_token_ids)):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            lp = (extras["logprobs"][i], extras["top_logprobs"][i]) if seq.row.logprobs else None
            self._num_generation_tokens += 1
            if seq.append(token, lp, now) and seq_id not in finished:
                self.scheduler.finish_request(seq_id, FinishReason.STOP)
                finished[seq_id] = seq.request
            touched[seq.parent.request_id] = seq.parent
        for seq_id, req in finished.items():
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                seq.finish(str(req.finish_reason or FinishReason.STOP), now)
                touched[seq.parent.request_id] = seq.parent
        outputs = []
        for state in touched.values():
            outputs.append(state.output())
            if state.finished:
                self._requests.pop(state.request_id, None)
        return outputs

    def _row_params(self, seq_id: str) -> RowParams:
        return self._seqs[seq_id].row

    def _history(self, seq_id: str):
        req = self._seqs[seq_id].request
        return req.prompt_token_ids, req.output_token_ids

    # -- observability ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats
        fed = self.runner.num_real_tokens + self.runner.num_padded_tokens
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_compilations=num_backend_compilations(), num_steps=s.num_steps,
            num_free_blocks=s.num_free_blocks, num_cached_blocks=s.num_cached_blocks,
            padded_token_fraction=self.runner.num_padded_tokens / fed if fed else 0.0)


def _model_name(spec: str, config_name: str) -> str:
    if spec == "default":
        return "SmolLM2-135M-Instruct"
    return config_name


def _enable_compilation_cache(folder: str | None) -> None:
    if not folder or jax.config.jax_compilation_cache_dir:
        return  # off, or already chosen by the caller (tests, notebooks)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


__all__ = ["CompletionOutput", "EngineStats", "LLMEngine"]
