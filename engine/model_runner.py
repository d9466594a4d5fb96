"""ModelRunner: the scheduler's plan in, sampled tokens out, through one compiled step per bucket.

1. At start-up every bucket (padded tokens T, padded sequences S) is lowered against abstract
   shapes and compiled ahead of time, with a progress bar; the persistent compilation cache makes
   a restart fast. A step whose shape falls outside the buckets is an error, never a recompile.
2. `execute(scheduler_output)` fills the bucket's flat input buffer (BatchBuilder; every StepInputs
   field is a view into it), moves it to the device in one transfer, and runs the bucket's
   executable, which unpacks it into StepInputs with static offsets. The KV cache is donated, so
   each layer's new K/V is written in place by one scatter.
3. The step returns one packed float32 array (see engine/sampler.py); one device-to-host copy
   gives every sampled id and logprob as Python numbers in a StepResult.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import jax
import numpy as np
from tqdm.auto import tqdm

from engine.kv_cache import allocate_kv_cache
from engine.sampler import sample
from engine.step_inputs import BatchBuilder, StepLayout
from models.config import ModelConfig
from models.llama import forward_paged
from scheduler import SchedulerOutput, StepResult

_compile_events = [0]


def _count_backend_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_events[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_backend_compiles)


def num_backend_compilations() -> int:
    """XLA compilations in this process so far (any function, hits of the persistent cache too)."""
    return _compile_events[0]


@dataclasses.dataclass(frozen=True)
class RunnerShapes:
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    max_blocks_per_seq: int
    num_blocks: int
    block_size: int
    history_len: int  # penalty history per row (max_model_len)
    num_logprobs: int  # top logprobs computed per row when asked
    sample_vocab_size: int  # ids the tokenizer knows: logits past it are never sampled

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest (T, S) pair that fits; S follows T (see `pairs`)."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest token bucket {self.token_buckets[-1]}")
        for t in self.token_buckets[i:]:
            s = self.seq_bucket_for_tokens(t)
            if s >= num_seqs:
                return t, s
        raise ValueError(f"{num_seqs} sequences exceed the largest sequence bucket {self.seq_buckets[-1]}")

    def seq_bucket_for_tokens(self, t: int) -> int:
        """Each token bucket compiles with one sequence count: enough rows for min(T, max rows)."""
        want = min(t, self.seq_buckets[-1])
        return self.seq_buckets[bisect.bisect_left(self.seq_buckets, want)]

    def pairs(self) -> list[tuple[int, int]]:
        return [(t, self.seq_bucket_for_tokens(t)) for t in self.token_buckets]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params, shapes: RunnerShapes, *, dtype: str,
                 attention_backend: str, interpret: bool = False, precompile: bool = True,
                 progress: bool = True):
        self.model_config = model_config
        self.params = params
        self.shapes = shapes
        self.dtype = dtype
        self.kv_cache = allocate_kv_cache(model_config, shapes.num_blocks, shapes.block_size, dtype)
        self.builder = BatchBuilder(
            max_blocks_per_seq=shapes.max_blocks_per_seq, block_size=shapes.block_size,
            history_len=shapes.history_len, vocab_size=shapes.sample_vocab_size)
        self._step = functools.partial(_step, config=model_config, attention_backend=attention_backend,
                                       interpret=interpret, num_logprobs=shapes.num_logprobs,
                                       sample_vocab_size=shapes.sample_vocab_size)
        self._compiled: dict[tuple[int, int], object] = {}
        self.num_compilations = 0  # buckets compiled by this runner
        self.num_padded_tokens = 0  # padding tokens fed so far (for the padding share)
        self.num_real_tokens = 0
        if precompile:
            self.compile_all(progress=progress)

    def compile_all(self, progress: bool = True) -> None:
        pairs = self.shapes.pairs()
        for t, s in tqdm(pairs, desc="compiling buckets", unit="bucket", disable=not progress, leave=False):
            self._executable(t, s)

    def _executable(self, t: int, s: int):
        key = (t, s)
        if key not in self._compiled:
            if key not in self.shapes.pairs():
                raise ValueError(f"shape (tokens={t}, seqs={s}) is not a declared bucket: {self.shapes.pairs()}")
            layout = self.builder.layout(t, s)
            step = jax.jit(functools.partial(self._step, layout=layout), donate_argnums=(1,))
            flat = jax.ShapeDtypeStruct((layout.size,), np.int32)
            self._compiled[key] = step.lower(self.params, self.kv_cache, flat).compile()
            self.num_compilations += 1
        return self._compiled[key]

    def execute(self, out: SchedulerOutput, row_params, histories) -> StepResult:
        num_tokens = out.num_batched_tokens
        t, s = self.shapes.bucket_for(num_tokens, len(out.scheduled))
        flat = self.builder.build(out, t, s, row_params, histories)
        self.num_real_tokens += num_tokens
        self.num_padded_tokens += t - num_tokens
        executable = self._executable(t, s)
        self.kv_cache, packed = executable(self.params, self.kv_cache, jax.device_put(flat))
        host = np.asarray(jax.device_get(packed))
        req_ids, token_ids, sampled_logprobs, top = [], [], [], []
        k = self.shapes.num_logprobs
        for row, sr in enumerate(out.scheduled):
            if not sr.sample:
                continue
            req_ids.append(sr.req_id)
            token_ids.append(int(host[row, 0]))
            sampled_logprobs.append(float(host[row, 1]))
            if k:
                top.append((host[row, 2 : 2 + k].astype(np.int64).tolist(), host[row, 2 + k :].tolist()))
        return StepResult(req_ids, token_ids, {"logprobs": sampled_logprobs, "top_logprobs": top})


def _step(params, kv_cache, flat, *, layout: StepLayout, config, attention_backend, interpret,
          num_logprobs, sample_vocab_size):
    inputs = layout.unpack(flat)
    kv_cache, logits = forward_paged(params, config, kv_cache, inputs,
                                     attention_backend=attention_backend, interpret=interpret)
    # A checkpoint may pad its vocabulary past the tokenizer's: those ids are never sampled.
    return kv_cache, sample(logits[:, :sample_vocab_size], inputs, num_logprobs=num_logprobs)
