"""ModelRunner: the scheduler's plan in, sampled tokens out, through one compiled step per bucket.

1. At start-up every bucket (padded tokens T, sequences S, logit rows L; buckets.py) is
   lowered against abstract shapes and compiled ahead of time, with a progress bar; the
   persistent compilation cache makes a restart fast; so is the scoring bucket (the largest
   token bucket with a logit row per token, for steps that score a prompt). A step whose shape
   falls outside the buckets is an error, never a recompile. With background_compile only the
   smallest and the largest bucket (and the scoring one) compile before serving; the rest compile
   on a thread, and meanwhile a step runs in the smallest compiled bucket that fits it
   (`compile_in_background`).
2. `execute(scheduler_output)` first updates the request table (request_table.py: the
   requests that left are dropped, the ones that joined get a slot), then fills the bucket's flat
   input buffer (BatchBuilder; every StepInputs field is a view into it), moves it to the device
   in one transfer, and runs the bucket's executable. The KV cache and the table state are
   donated, so each layer's new K/V and each sampled token's count are written in place.
3. The step returns one packed float32 array (sampler.py); one device-to-host copy gives every
   sampled id and its logprobs, read into a StepResult (step_result.py): per request, tokens and
   typed logprobs (TokenLogprobs). A row that verified d drafts (engine/spec_decode/) keeps its
   samples up to the first differing from its draft, the rest num_rejected_tokens (as counted).
The runner never calls the scheduler or the engine back: everything it needs is in the output.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from engine.step import program
from engine.step.buckets import Bucket, RunnerShapes
from engine.step.kv_cache import allocate_kv_cache, cache_groups
from engine.step.placement import Placement
from engine.step.program import lower_bucket, make_step, serve_layout
from engine.step.request_table import RequestTable
from engine.step.step_inputs import BatchBuilder, StepLayout
from engine.step.step_result import hidden_rows, read_result
from models.config import ModelConfig
from models.quant import QuantizedWeight
from pallas_kernels import kv_layout_for
from pallas_kernels.kv_quant import scale_layout
from scheduler import SchedulerOutput, StepResult

_compile_events = [0]


def _count_backend_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_events[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_backend_compiles)


def num_backend_compilations() -> int:
    """XLA compilations in this process so far (any function, hits of the persistent cache too)."""
    return _compile_events[0]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params, shapes: RunnerShapes, *, dtype: str,
                 attention_backend: str, interpret: bool = False, layer_loop: str = "unrolled",
                 precompile: bool = True, progress: bool = True, placement: Placement | None = None,
                 background_compile: bool = False, keep_hidden: bool = False,
                 executables: dict | None = None, lora=None, lora_method: str = "masked",
                 quantization: str | None = None, activation_rows: int | None = None,
                 kv_cache_dtype: str = "auto", warmup: bool = False, product_forms=None, compiler_options=None,
                 rows_kernel: str = "jnp"):
        """lora: engine/lora/slots.LoRASlots, the adapters' device slots (their buffers join the
        served weights as params["lora"]; the step's products per token use `lora_method`,
        models/lora.py); None: no adapters. warmup: run every bucket compiled at start-up once
        (`warm_up`). product_forms: served params -> the CPU's product form table (None: static);
        compiler_options: padded tokens -> XLA's options for that bucket's compile (cpu_compile.py);
        rows_kernel: how the xla path's decode rows run (pallas_kernels/xla_forms.py ROWS_KERNELS)."""
        self.model_config, self.compiler_options = model_config, compiler_options or (lambda tokens: None)
        self.rows_kernel, self.layer_loop = rows_kernel, layer_loop  # engine/config.py LAYER_LOOPS
        self.shapes, self.dtype, self.placement = shapes, dtype, placement
        bits = attention_backend == "xla"
        self.kv_layout = kv_layout_for(attention_backend)  # the pages' layout: head-major on the xla path
        # The cache groups (engine/step/kv_cache.py): one, or two with a sliding group; an 8-bit
        # cache's scales as the backend reads them.
        cache_blocks, sliding_blocks, tables = cache_groups(model_config, shapes.num_blocks, shapes.num_sliding_blocks)
        cache = dict(bits=bits, kv_cache_dtype=kv_cache_dtype, num_sliding_blocks=sliding_blocks,
                     scale_layout=scale_layout(attention_backend), kv_layout=self.kv_layout)
        if placement is None:
            # Served layout (models/llama.py): q/k/v and gate/up fused into one product each;
            # stacked 16-bit layers as their bits.
            # (Host arrays, a LoadedModel shared with sharded engines, move to the device here.)
            # Quantized weights (models/quant.py) are made here from the float ones, per output
            # channel of the served layout; the float copy is dropped with the caller's.
            self.params = serve_layout(jax.tree.map(jnp.asarray, params), layer_loop, quantization,
                                       activation_rows)
            self.kv_cache = allocate_kv_cache(model_config, cache_blocks, shapes.block_size, dtype, **cache)
        else:
            if keep_hidden:
                raise ValueError("ModelRunner(keep_hidden=True) runs on one device (no placement)")
            layers = params["layers"]
            first = layers[0] if isinstance(layers, list) else layers
            if (quantization is not None) != isinstance(first["qkv_proj"], QuantizedWeight):
                raise ValueError(f"ModelRunner(quantization={quantization!r}) on a mesh takes the weights "
                                 "placed as that says: Placement.place(quantization=...)")
            # On a mesh (placement.py): params already padded, fused per shard and placed
            # shard by shard (and quantized there: Placement.place(quantization=...)); the cache
            # split on KV heads, an 8-bit one's scales too; inputs and the table replicated.
            self.params = params
            self.kv_cache = allocate_kv_cache(placement.layout.padded, cache_blocks, shapes.block_size, dtype,
                                              sharding=placement.kv_sharding(self.kv_layout), **cache)
        self.product_forms = product_forms(self.params) if product_forms is not None else None
        self.lora = lora
        if lora is not None:
            self.params = {**self.params, "lora": lora.buffers}
        self.table = RequestTable(shapes.max_num_seqs, shapes.sample_vocab_size,
                                  sharding=None if placement is None else placement.replicated)
        self.builder = BatchBuilder(max_blocks_per_seq=shapes.max_blocks_per_seq,
                                    block_size=shapes.block_size, vocab_size=shapes.sample_vocab_size,
                                    tables=tables)
        self._step = make_step(model_config, shapes, attention_backend=attention_backend,
                               interpret=interpret, layer_loop=layer_loop, placement=placement,
                               keep_hidden=keep_hidden, lora_method=lora_method)
        # keep_hidden (a draft head reads it, engine/spec_decode/draft_head.py): after each step,
        # `hidden` is the target's final hidden state at its logit rows (float32 [max L, e], on the
        # device, padded to the most logit rows of any bucket so its shape never changes) and `hidden_rows`
        # maps each request that sampled to the row of its last kept token.
        self.keep_hidden = keep_hidden
        self.hidden: jax.Array | None = None
        self.hidden_rows: dict[str, int] = {}
        self._compiled: dict[Bucket, object] = {}
        # TPU: the cache's layout pinned to the kernels' (program.pins_cache_layout), chosen by the
        # first compile; the cache moves into it once, every other bucket is compiled for it.
        self.pins_cache = program.pins_cache_layout(attention_backend)
        self.cache_formats = None
        # Loaded instead of compiled (engine/step/executables.py, checked against a manifest).
        self._loaded: dict[Bucket, object] = dict(executables or {})
        self._idle_masks: dict[Bucket, jax.Array] = {}
        self.lora_rank_steps: dict[int, int] = {}  # steps run per LoRA rank bucket (RunnerShapes.lora_ranks)
        self.num_padded_tokens = 0  # padding tokens fed so far (for the padding share)
        self.num_real_tokens = 0
        # A profiler (experiments/bench/profile_step.py) sets this to get each step's phases timed;
        # then the host waits for the transfer and the compute separately (None: no waiting).
        self.profile = None
        self._compile_thread: threading.Thread | None = None
        self._ran: set[Bucket] = set()  # buckets whose executable has run (a step or a warm-up)
        self.warmup = warmup
        if precompile and background_compile:
            self.compile_in_background(progress=progress)
        elif precompile:
            self.compile_all(progress=progress)
        if warmup:
            self.warm_up()

    @property
    def _input_sharding(self):
        return None if self.placement is None else self.placement.replicated

    def _put(self, host: np.ndarray) -> jax.Array:
        """A host array onto the replica's devices, replicated. On a mesh spanning processes
        (multi-host), each process places its own copy of the same data (every process builds the
        same step from the same SchedulerOutput) with no cross-process traffic: jax.device_put onto
        such a sharding would first run a collective checking the copies are equal, and two
        processes placing different-sized arrays in a different order (the idle masks of buckets
        compiled on threads) ran mismatched collectives (gloo: "Received data size doesn't match
        expected size")."""
        sharding = self._input_sharding
        if sharding is None or sharding.is_fully_addressable:
            return jax.device_put(host, sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    @property
    def sample_vocab_size(self) -> int:
        return self.shapes.sample_vocab_size

    @property
    def healthy(self) -> bool:
        """False once a failed step has consumed the donated device state (cache, table)."""
        arrays = (*jax.tree.leaves(self.kv_cache), self.table.state.output_counts)
        return not any(a.is_deleted() for a in arrays)

    def compile_all(self, progress: bool = True, workers: int | None = None,
                    buckets: list[Bucket] | None = None) -> None:
        """Compiles every bucket not compiled yet. Lowering (Python tracing) runs here, one bucket
        after another; XLA's compilations, which release the GIL, run on `workers` threads (the
        CPU count by default): on a 2-core CPU start-up compiles in about half the time."""
        todo = [b for b in (buckets or self.shapes.all_buckets()) if b not in self._compiled]
        if not todo:
            return
        if self.pins_cache and self.cache_formats is None:  # one compile chooses the cache's layout
            self._compiled[todo[0]] = self._compile(todo[0])
        rest = [b for b in todo if b not in self._compiled]
        workers = max(1, min(len(rest), workers or os.cpu_count() or 1))
        bar = tqdm(total=len(rest), desc="compiling buckets", unit="bucket", disable=not progress, leave=False)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
            futures = {pool.submit(self._compile, bucket): bucket for bucket in rest}
            for future in concurrent.futures.as_completed(futures):
                self._compiled[futures[future]] = future.result()
                bar.update()
        bar.close()
        for bucket in todo:  # in bucket order, the same on every process of a multi-host mesh
            self._token_mask(bucket, None)  # the bucket's resident idle mask

    def compile_in_background(self, progress: bool = True) -> None:
        """Compiles the smallest and the largest bucket (and the scoring bucket, which no other
        serves) now, the others on a background thread (smallest first). Until a bucket is
        compiled, its steps run in the smallest compiled bucket that fits them (padded further,
        never recompiled): the engine serves every shape from the start, and reaches its
        steady-state step times once `all_compiled`."""
        buckets = self.shapes.buckets()
        self._abstract_state  # noqa: B018 (taken now, on this thread)
        scoring = [] if self.shapes.scoring_bucket is None else self.shapes.with_ranks([self.shapes.scoring_bucket])
        largest = [b for b in buckets if b.padded_tokens == buckets[-1].padded_tokens]  # every LoRA rank
        self.compile_all(progress=progress, buckets=[buckets[0], *largest, *scoring])
        rest = [b for b in buckets if b not in self._compiled]

        stop = threading.Event()

        def work():
            start = time.perf_counter()
            for bucket in rest:
                if stop.is_set():  # the process is exiting (_finish_compiling)
                    return
                try:
                    executable = self._compile(bucket)
                except Exception:  # the bucket stays unused; larger ones keep serving its steps
                    logging.exception("jaxserve: compiling bucket %s in the background failed", bucket)
                    continue
                self._token_mask(bucket, None)
                self._compiled[bucket] = executable  # published last: a step sees it whole
            logging.info("jaxserve: %d of %d buckets compiled, the last %d in the background in %.1f s",
                         len(self._compiled), len(self.shapes.all_buckets()), len(rest),
                         time.perf_counter() - start)

        self._compile_thread = threading.Thread(target=work, name="compile-buckets", daemon=True)
        self._compile_thread.start()
        # A daemon thread still inside an XLA compile when the interpreter finalizes aborts the
        # process ("FATAL: exception not rethrown"): at exit, stop after the current bucket.
        atexit.register(_finish_compiling, stop, self._compile_thread)

    @property
    def all_compiled(self) -> bool:
        return len(self._compiled) == len(self.shapes.all_buckets())

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until the background compilation (if any) is done; True when every bucket is."""
        if self._compile_thread is not None:
            self._compile_thread.join(timeout)
        return self.all_compiled

    def _layout(self, bucket: Bucket) -> StepLayout:
        return self.builder.layout(bucket.padded_tokens, bucket.padded_seqs, bucket.padded_logits)

    def _executable(self, bucket: Bucket):
        if bucket not in self._compiled:
            if bucket not in self.shapes.all_buckets():
                raise ValueError(f"shape {bucket} is not a declared bucket: {self.shapes.all_buckets()}")
            self._compiled[bucket] = self._compile(bucket)
            self._token_mask(bucket, None)
        return self._compiled[bucket]

    def _compile(self, bucket: Bucket):
        loaded = self._loaded.pop(bucket, None)
        compiled = loaded if loaded is not None else self._lower(bucket).compile(self.compiler_options(bucket.padded_tokens))
        if self.pins_cache and self.cache_formats is None:  # the cache, unwritten yet, remade in it
            self.cache_formats, self.kv_cache = program.pin_cache_layout(self.kv_cache, compiled)
        return compiled

    def _lower(self, bucket: Bucket):
        formats = (self.cache_formats or "auto") if self.pins_cache else None
        return lower_bucket(self._step, self.builder, bucket, self._abstract_state, self._input_sharding,
                            cache_formats=formats, product_forms=self.product_forms, rows_kernel=self.rows_kernel)

    @functools.cached_property
    def _abstract_state(self):
        """(params, cache, table) as shapes and shardings, taken once before the first step: a
        background compilation must not touch the live cache, which each step donates."""
        # One device: no sharding, as lowering the uncommitted arrays themselves would (a committed
        # result would make jitted helpers over the table, e.g. _fill_history, compile again).
        placed = self.placement is not None
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if placed else None)  # noqa: E731
        return jax.tree.map(spec, (self.params, self.kv_cache, self.table.state))

    def _token_mask(self, bucket: Bucket, built) -> jax.Array:
        """The step's token_mask argument: sent when a row is constrained; otherwise a resident
        zero buffer per bucket (allocated with the bucket's executable), so unconstrained steps move
        no mask bytes."""
        if built is not None and built.mask is not None:
            return self._put(built.mask)
        if bucket not in self._idle_masks:
            self._idle_masks[bucket] = self._put(np.zeros_like(self._layout(bucket).mask))
        return self._idle_masks[bucket]

    def execute(self, out: SchedulerOutput) -> StepResult:
        prof = self.profile
        t0 = time.perf_counter() if prof is not None else 0.0
        self.table.apply(out)
        lora_slot_of = None
        if self.lora is not None:
            self.lora.apply(out)  # slots of the requests that joined, written if not resident
            self.params["lora"] = self.lora.buffers
            lora_slot_of = self.lora.slot_of_req
        self.hidden_rows = {}
        if out.is_empty:
            return StepResult([], [])
        num_logits = sum(sr.num_logits for sr in out.scheduled)
        ready = None if self._compile_thread is None or self.all_compiled else self._compiled.__contains__
        rank = self.lora.step_rank(out) if self.lora is not None and self.shapes.lora_ranks else 0
        bucket = self.shapes.bucket_for(out.num_batched_tokens, len(out.scheduled), num_logits, ready=ready,
                                        lora_rank=rank)
        if bucket.lora_rank is not None:
            self.lora_rank_steps[bucket.lora_rank] = self.lora_rank_steps.get(bucket.lora_rank, 0) + 1
        built = self.builder.build(out, self._layout(bucket), self.table, lora_slot_of)
        executable = self._executable(bucket)
        if prof is not None:
            t1 = time.perf_counter()
            flat = self._put(built.buffer).block_until_ready()
            mask = self._token_mask(bucket, built).block_until_ready()
            t2 = time.perf_counter()
            self.kv_cache, self.table.state, packed, *hidden = executable(
                self.params, self.kv_cache, self.table.state, flat, mask)
            packed.block_until_ready()
            t3 = time.perf_counter()
        else:
            self.kv_cache, self.table.state, packed, *hidden = executable(
                self.params, self.kv_cache, self.table.state,
                self._put(built.buffer), self._token_mask(bucket, built))
        host = np.asarray(jax.device_get(packed))
        self._ran.add(bucket)
        t4 = time.perf_counter() if prof is not None else 0.0
        self.num_real_tokens += out.num_batched_tokens
        self.num_padded_tokens += bucket.padded_tokens - out.num_batched_tokens
        num_kept = built.row_num_logits.copy()
        result = read_result(out, host, built.row_num_logits, built.row_num_logits > 0, num_kept,
                             num_logprobs=self.shapes.num_logprobs, verifies=self.shapes.logits_per_seq > 1,
                             wants_logprobs=self.table.wants_logprobs_np[built.row_slots])
        self.table.commit(built.row_slots, num_kept)
        if hidden:
            self.hidden, self.hidden_rows = hidden[0], hidden_rows(out, built.row_num_logits, result)
        if prof is not None:
            prof.record_runner(bucket, build=t1 - t0, h2d=t2 - t1, device=t3 - t2, d2h=t4 - t3,
                               read=time.perf_counter() - t4)
        return result

    def cold_buckets(self) -> list[Bucket]:
        """Compiled buckets whose executable has not run yet, smallest first."""
        compiled = list(self._compiled)  # a snapshot: the compile thread may publish meanwhile
        order = {b: i for i, b in enumerate(self.shapes.all_buckets())}
        return sorted((b for b in compiled if b not in self._ran), key=order.__getitem__)

    def warm_up(self, buckets: list[Bucket] | None = None) -> list[Bucket]:
        """Runs each of `buckets` (default: every cold one) once on an all-padding step, so that
        no request pays an executable's first run: on XLA:CPU that run costs ~0.3 s more than
        the next (the default model, every bucket but T = 1; BUILD_NOTES.md "Warm-up").

        An all-padding step is what fills every bucket's unused rows anyway: tokens write K/V
        only into the null block, logit rows sample into the request table's padding slot, no
        request's state changes. Returns the buckets run, in order. Every process of a multi-host
        mesh runs the same ones at start-up (same config, same order), so their collectives match."""
        todo = self.cold_buckets() if buckets is None else [b for b in buckets if b not in self._ran]
        empty = SchedulerOutput(step_id=-1, scheduled=[], num_batched_tokens=0, finished_req_ids=[],
                                aborted_req_ids=[], preempted_req_ids=[])
        start = time.perf_counter()
        for bucket in todo:
            built = self.builder.build(empty, self._layout(bucket), self.table)
            self.kv_cache, self.table.state, packed, *_ = self._executable(bucket)(
                self.params, self.kv_cache, self.table.state, self._put(built.buffer),
                self._token_mask(bucket, built))
            packed.block_until_ready()
            self._ran.add(bucket)
        if todo:
            logging.log(logging.INFO if buckets is None else logging.DEBUG,
                        "jaxserve: warmed %d bucket(s) in %.1f s", len(todo), time.perf_counter() - start)
        return todo

    def warm_up_next(self) -> bool:
        """With warmup on, runs the smallest cold bucket once (`warm_up`); True if it ran one.
        For a server's idle moments: buckets compiled in the background get warm before a
        request needs them. A no-op on a multi-process mesh, whose steps every process must run
        together (multihost.py): there only the start-up warm-up runs."""
        if not self.warm_up_pending():
            return False
        cold = self.cold_buckets()
        return bool(cold and self.warm_up(cold[:1]))

    def warm_up_pending(self) -> bool:
        """Whether warm_up_next has (or, while buckets still compile in the background, will have)
        a bucket to run."""
        if not self.warmup or jax.process_count() > 1:
            return False
        compiling = self._compile_thread is not None and self._compile_thread.is_alive()
        return compiling or bool(self.cold_buckets())

def _finish_compiling(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join(timeout=300)
