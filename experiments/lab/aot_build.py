"""The engine's step programs built for a target by its own compiler, from abstract weights.

`compile_for_target(engine_config, model_config, target)` follows what `build_parts` and
ModelRunner do on that target (engine/core/builder.py, engine/step/program.py): the dtype, the
attention backend and the layer loop the platform resolves to, the (1, tp) mesh of one replica
with its shardings and head padding, the buckets, the KV cache's pools sized as the engine sizes
them (engine/step/kv_cache.py pool_sizes: kv_cache_memory_fraction of what the weights leave),
the donated cache and request table. The weights are ShapeDtypeStructs (`served_params_spec`):
nothing the size of the model is allocated.
Each bucket's step is lowered and compiled for the target's compile-only devices
(experiments/lab/targets.py), and the compiled programs answer for memory (`memory_analysis`),
cost (`cost_analysis`, where the backend gives it) and collectives (the optimized HLO).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from engine.config import (
    EngineConfig,
    resolve_activation_rows,
    resolve_dtype,
    resolve_layer_loop,
    resolve_max_model_len,
    resolve_smoothing,
)
from engine.core.builder import rows_kernel, uses_sliding_groups
from engine.step.buckets import Bucket, RunnerShapes, resolve_seq_buckets, resolve_token_buckets
from engine.step.executables import manifest, save_executables
from engine.step.kv_cache import (
    bytes_per_block,
    cache_groups,
    kv_shape,
    kv_shards,
    pool_sizes,
    scaled_sharding,
)
from engine.step.mesh import replica_meshes
from engine.step.placement import Placement
from engine.step.program import (
    lower_bucket,
    make_step,
    pins_cache_layout,
    served_params_spec,
    table_state_spec,
)
from engine.step.step_inputs import BatchBuilder
from engine.step.tpu_cache_layout import laid_out_factor
from experiments.lab.aot_results import (
    BucketResult,
    Build,
    cache_copy_bytes,
    count_collectives,
    devices_for,
    kv_bytes_as_laid_out,
    nbytes,
    refused,
    split_unrolled,
    target_figures,
    tree_bytes_per_device,
    with_sharding,
)
from experiments.lab.aot_side_programs import draft_head_programs, transfer_programs
from models.config import ModelConfig
from models.sharding import kv_cache_spec, param_specs
from pallas_kernels import kv_layout_for, resolve_backend
from pallas_kernels.kv_quant import allocate_scaled, scale_layout


def compile_for_target(config: EngineConfig, model: ModelConfig, target_name: str, *,
                       draft_model: ModelConfig | None = None, draft_head=None, roofline: bool = True,
                       progress=print) -> Build:
    """Every bucket's step compiled for `target_name` (see the module docstring). With
    speculative_config's draft_model (its ModelConfig as `draft_model`) or draft_head (its
    DraftHeadConfig as `draft_head`), the draft's own programs too. roofline=False: on TPU, the
    FLOPs and bytes are the scanned program's own (one layer's), without the unrolled compiles."""
    platform, hbm, usable, peak, bandwidth = target_figures(target_name)
    spec = config.speculative_config
    drafting = spec.method if spec is not None and spec.method in ("draft_model", "draft_head") else None
    if drafting and (config.tensor_parallel_size > 1 or config.data_parallel_size > 1):
        raise ValueError(f"speculative_config method {drafting!r} runs on one device: use "
                         "tensor_parallel_size=1 and data_parallel_size=1 with it (ngram works on a mesh)")
    if drafting == "draft_model" and draft_model is None:
        raise ValueError("speculative_config method 'draft_model': pass the draft's ModelConfig")
    if drafting == "draft_head" and draft_head is None:
        raise ValueError("speculative_config method 'draft_head': pass the head's DraftHeadConfig")
    # With disaggregation each pool is a (1, tp) mesh of its own devices, tp its device count.
    tp = config.disaggregation.prefill if config.disaggregation else config.tensor_parallel_size
    devices = devices_for(target_name, tp * config.data_parallel_size)
    dtype = resolve_dtype(config, platform)
    backend = resolve_backend(config.attention_backend, platform)
    layer_loop = resolve_layer_loop(config, platform)
    rows = rows_kernel(config, platform, backend)  # the CPU's decode rows, as the engine would run them
    mesh = replica_meshes(tp, 1, devices)[0] if tp > 1 else None
    placement_for = lambda m: Placement.for_mesh(mesh, m, config.expert_parallel_size) if mesh else None  # noqa: E731
    placement = placement_for(model)
    max_model_len = resolve_max_model_len(config, model.max_position_embeddings)
    bs = config.block_size
    max_blocks_per_seq = -(-max_model_len // bs)

    activation_rows = resolve_activation_rows(config, platform)
    if config.quantization == "gguf":
        raise ValueError("--quantization=gguf serves a GGUF file's own blocks (Q8_0/Q4_*/Q5_*/Q2_K-Q6_K), which a build from the "
                         "model's config alone does not have; experiments.aot takes int8 or fp8")
    smoothing = resolve_smoothing(config, platform) if mesh is None else None
    quant = dict(quantization=config.quantization, activation_rows=activation_rows, smoothing=smoothing is not None)
    params, replicated, kv_sharding, kv_config = _abstract_params(model, dtype, layer_loop, placement, devices[0],
                                                                  kv_layout=kv_layout_for(backend), **quant)
    lora_method = "masked"
    if config.enable_lora:  # the adapter slots join the served weights (engine/lora/slots.py)
        from models.lora import LORA_PRODUCT, allocate_lora_buffers
        from models.sharding import MODEL_AXIS, lora_partition_specs

        lora_method = config.lora_product or LORA_PRODUCT[platform]
        lora = jax.eval_shape(lambda: allocate_lora_buffers(
            model if placement is None else placement.layout.padded, config.max_loras + 1,
            config.max_lora_rank, jax.numpy.dtype(dtype)))
        if placement is None:
            lora_shardings = jax.tree.map(lambda _: SingleDeviceSharding(devices[0]), lora)
        else:
            lora_shardings = jax.tree.map(lambda s: NamedSharding(placement.mesh, s),
                                          lora_partition_specs(lora, MODEL_AXIS),
                                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        params = {**params, "lora": with_sharding(lora, lora_shardings)}
    weights = tree_bytes_per_device(params)
    layout = scale_layout(backend)  # an 8-bit cache's scales as the backend reads them
    per_block = bytes_per_block(kv_config, bs, dtype, config.kv_cache_dtype, scale_layout=layout, shards=tp) // tp
    # engine/step/kv_cache.py cache_budget on an accelerator: a fraction of what is free
    budget = int(max(0, usable - weights) * config.kv_cache_memory_fraction)
    if backend == "pallas_tpu" and config.num_kv_blocks is None:  # as the engine's builder: the padded layout
        budget = int(budget / laid_out_factor(placement.layout.local if placement else kv_config, block_size=bs,
                                              dtype=dtype, kv_cache_dtype=config.kv_cache_dtype, device=devices[0]))
    if platform == "cpu":
        budget = config.kv_cache_bytes
    num_blocks, num_sliding_blocks = pool_sizes(
        config, kv_config, budget, sliding=uses_sliding_groups(config, model), dtype=dtype,
        max_model_len=max_model_len, tp=tp, scale_layout=layout)
    shapes = RunnerShapes(
        token_buckets=resolve_token_buckets(config), seq_buckets=resolve_seq_buckets(config),
        max_blocks_per_seq=max_blocks_per_seq, num_blocks=num_blocks, block_size=bs,
        num_logprobs=config.max_logprobs, sample_vocab_size=model.vocab_size,
        logits_per_seq=1 + (spec.num_speculative_tokens if spec is not None else 0),
        prompt_scoring=config.prompt_scoring_bucket, num_sliding_blocks=num_sliding_blocks)
    kv_leaf = _kv_leaf(kv_config, num_blocks, bs, dtype, backend, kv_sharding)
    kv_state = _kv_state(kv_config, shapes, dtype, backend, kv_sharding, config.kv_cache_dtype,
                         on_mesh=placement is not None)
    table = table_state_spec(shapes)
    table = with_sharding(table, jax.tree.map(lambda _: replicated, table))
    state = (params, kv_state, table)
    keep_hidden = drafting == "draft_head"
    step = make_step(model, shapes, attention_backend=backend, interpret=False,
                     layer_loop=layer_loop, placement=placement, keep_hidden=keep_hidden, lora_method=lora_method)
    # (The unrolled variants carry no adapter slots and a plain cache: with LoRA or an 8-bit
    # cache no roofline is reported.)
    cost_model = _LayerCost(model, shapes, backend, dtype, placement_for, devices[0], quant) \
        if (roofline and platform == "tpu" and layer_loop != "unrolled" and not config.enable_lora
            and config.kv_cache_dtype == "auto") else None
    # Without the unrolled compiles a scanned program's own cost holds one layer: none reported.
    results = _compile_buckets(step, shapes, shapes.all_buckets(), state, replicated, layer_loop=layer_loop,
                               tables=cache_groups(model, shapes.num_blocks, shapes.num_sliding_blocks)[2],
                               num_layers=model.num_layers, peak=peak, bandwidth=bandwidth,
                               cost_model=cost_model, progress=progress,
                               own_cost=layer_loop == "unrolled" or platform != "tpu", pin_cache=pins_cache_layout(backend),
                               rows_kernel=rows)
    draft = None
    if drafting == "draft_model":
        draft = _draft_model_programs(draft_model, shapes, dtype=dtype, backend=backend, layer_loop=layer_loop,
                                      device=devices[0], peak=peak, bandwidth=bandwidth, progress=progress,
                                      rows_kernel=rows)
    elif drafting == "draft_head":
        draft = draft_head_programs(draft_head, params, shapes, spec.num_speculative_tokens, progress=progress)
    transfers = (transfer_programs(config, target_name, kv_leaf, max_blocks_per_seq, kv_layout_for(backend))
                 if config.disaggregation else [])
    meta = manifest(platform=platform, device_kind=devices[0].device_kind, model=model, dtype=dtype,
                    attention_backend=backend, layer_loop=layer_loop, tensor_parallel_size=tp,
                    shapes=shapes, quantization=config.quantization, activation_rows=activation_rows,
                    kv_cache_dtype=config.kv_cache_dtype, smoothing=smoothing, rows_kernel=rows)
    return Build(
        target=target_name, platform=platform, dtype=dtype, attention_backend=backend,
        layer_loop=layer_loop, tensor_parallel_size=tp, max_model_len=max_model_len, block_size=bs,
        num_blocks=num_blocks, hbm_bytes=hbm, usable_bytes=usable, weights_bytes=weights,
        kv_cache_bytes=tree_bytes_per_device(kv_state), table_bytes=tree_bytes_per_device(table),
        kv_bytes_per_block=per_block, buckets=results, shapes=shapes, manifest=meta,
        transfers=transfers, draft=draft, kv_cache_laid_out_bytes=kv_bytes_as_laid_out(results, kv_state))


def _abstract_params(model: ModelConfig, dtype: str, layer_loop: str, placement, device, *,
                     quantization: str | None = None, activation_rows: int | None = None,
                     smoothing: bool = False, kv_layout: str = "token_major"):
    """(weights with their shardings, the replicated sharding, the KV cache's, the per-device
    KV shape's config) as the runner would serve them."""
    params = served_params_spec(model, dtype=dtype, layer_loop=layer_loop, placement=placement,
                                quantization=quantization, activation_rows=activation_rows,
                                smoothing=smoothing)
    if placement is None:
        single = SingleDeviceSharding(device)
        return with_sharding(params, jax.tree.map(lambda _: single, params)), single, single, model
    specs = param_specs(params)
    shardings = jax.tree.map(lambda s: NamedSharding(placement.mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return (with_sharding(params, shardings), placement.replicated,
            NamedSharding(placement.mesh, kv_cache_spec(kv_layout)), placement.layout.padded)


def _kv_leaf(kv_config: ModelConfig, num_blocks: int, bs: int, dtype: str, backend: str, sharding,
             num_layers: int | None = None):
    bits = backend == "xla" and np.dtype(jax.numpy.dtype(dtype)).itemsize == 2
    kv_dtype = np.uint16 if bits else jax.numpy.dtype(dtype)
    layers = kv_config.num_layers if num_layers is None else num_layers
    shape = kv_shape(kv_config, layers, num_blocks, bs, kv_layout_for(backend))  # as the runner allocates it
    return jax.ShapeDtypeStruct(shape, kv_dtype, sharding=sharding)


def _kv_state(kv_config: ModelConfig, shapes: RunnerShapes, dtype: str, backend: str, sharding,
              kv_cache_dtype: str = "auto", *, on_mesh: bool = False) -> tuple:
    """The cache as the runner allocates it (engine/step/kv_cache.py): (k, v), or with a sliding
    group (shapes.num_sliding_blocks) the global layers' pair, then the sliding layers'. An 8-bit
    cache's scales are split on KV heads like its values on a mesh."""
    first, second, _ = cache_groups(kv_config, shapes.num_blocks, shapes.num_sliding_blocks)
    groups = [(kv_config.num_layers, first)]
    if second:
        groups = [(kv_config.num_layers_of_kind("full_attention"), first),
                  (kv_config.num_layers_of_kind("sliding_attention"), second)]
    state = ()
    for layers, blocks in groups:
        leaf = _kv_leaf(kv_config, blocks, shapes.block_size, dtype, backend, sharding, layers)
        if kv_cache_dtype != "auto":  # values and scales (pallas_kernels/kv_quant.py)
            layout, shards = scale_layout(backend), kv_shards(sharding) if on_mesh else 1
            leaf = jax.eval_shape(functools.partial(allocate_scaled, leaf.shape, kv_cache_dtype, layout, shards))
            split = (scaled_sharding(sharding, kv_cache_dtype, layout) if on_mesh
                     else jax.tree.map(lambda _: sharding, leaf))
            leaf = with_sharding(leaf, split)
        state += (leaf, leaf)
    return state


def _compile_buckets(step, shapes: RunnerShapes, buckets, state, replicated, *, layer_loop: str,
                     num_layers: int, peak: float, bandwidth: float, cost_model=None, progress=print,
                     label: str = "bucket", own_cost: bool = True, tables: str = "global",
                     pin_cache: bool = False, rows_kernel: str = "jnp") -> list[BucketResult]:
    """Each bucket's step compiled as the runner compiles it (pin_cache: the cache's layout chosen
    by the first compile, then pinned for the rest, as ModelRunner does on the TPU)."""
    builder = BatchBuilder(max_blocks_per_seq=shapes.max_blocks_per_seq, block_size=shapes.block_size,
                           vocab_size=shapes.sample_vocab_size, tables=tables)
    results, formats = [], "auto" if pin_cache else None
    for bucket in buckets:
        start = time.perf_counter()
        lowered = lower_bucket(step, builder, bucket, state, replicated, cache_formats=formats, rows_kernel=rows_kernel)
        try:
            compiled = lowered.compile()
            if pin_cache and formats == "auto":
                formats = compiled.input_formats[0][1]
        except Exception as e:  # XLA:TPU refuses a program that does not fit its HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            results.append(refused(bucket, time.perf_counter() - start, str(e)))
            if progress:
                progress(f"  {label} T={bucket.padded_tokens:5d} S={bucket.padded_seqs:4d}: "
                         f"refused by the compiler: {results[-1].error}")
            continue
        seconds = time.perf_counter() - start
        mem = compiled.memory_analysis()
        if cost_model is not None:  # the loop's cost counted once per layer, not once in all
            flops, accessed = cost_model.cost(bucket, builder)
        elif own_cost:
            flops, accessed = _cost(compiled)
        else:
            flops = accessed = None
        roof = max(flops / peak, accessed / bandwidth) if flops is not None and accessed is not None else None
        decode = bucket.padded_tokens == bucket.padded_seqs and bucket.padded_logits == bucket.padded_seqs
        text = compiled.as_text() or ""
        inside, outside = count_collectives(text)
        if layer_loop == "unrolled":  # no loop body: the layers' collectives are all in the entry
            inside, outside = split_unrolled(outside, num_layers)
        results.append(BucketResult(
            bucket.padded_tokens, bucket.padded_seqs, bucket.padded_logits, seconds,
            int(mem.temp_size_in_bytes) if mem else 0, int(mem.generated_code_size_in_bytes) if mem else 0,
            flops, accessed, roof, bucket.padded_seqs / roof if roof and decode else None,
            inside, outside, compiled, cache_copy_bytes=cache_copy_bytes(text, state[1])))
        if progress:
            progress(f"  {label} T={bucket.padded_tokens:5d} S={bucket.padded_seqs:4d} "
                     f"L={bucket.padded_logits:4d}: compiled in {seconds:6.2f} s, "
                     f"temp {results[-1].temp_bytes / 2**20:9.1f} MiB")
    return results


def _cost(compiled) -> tuple[float | None, float | None]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) and cost else cost
    flops = float(cost["flops"]) if cost and "flops" in cost else None
    accessed = float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else None
    return flops, accessed


class _LayerCost:
    """FLOPs and bytes of a step over all its layers. XLA's cost analysis counts a while loop's
    body once, whatever its trip count, so the scanned step's own figures hold one layer: the
    step is compiled again unrolled with 2p and 3p layers (p: the layer pattern's period) and the
    difference, one period's cost, is extrapolated to the model's layer count. (Not p and 2p: with
    the cache's layout pinned, program.pins_cache_layout, a one-layer stacked cache is laid out
    unlike a deeper one, and the bytes extrapolated from it were 21 % over the full program's.)"""

    def __init__(self, model, shapes, backend, dtype, placement_for, device, quant):
        self.period, self.num_layers = model.layer_period, model.num_layers
        self.formats = "auto" if pins_cache_layout(backend) else None  # as the runner compiles it
        self.variants = []
        for n in (2 * self.period, 3 * self.period):  # (one layer's stacked cache lays out unlike the rest)
            small = dataclasses.replace(model, num_layers=n,
                                        layer_types=model.layer_types[:n] if model.layer_types else None)
            placement = placement_for(small)
            params, replicated, kv_sharding, kv_config = _abstract_params(small, dtype, "unrolled", placement, device,
                                                                          kv_layout=kv_layout_for(backend), **quant)
            # The real cache: XLA's cost analysis charges a Pallas call by its own cost estimate and
            # operands, so the figures are what it says of the unrolled program (tested against one).
            kv = _kv_state(kv_config, shapes, dtype, backend, kv_sharding)
            table = table_state_spec(shapes)
            table = with_sharding(table, jax.tree.map(lambda _, r=replicated: r, table))
            step = make_step(small, shapes, attention_backend=backend, interpret=False, layer_loop="unrolled",
                             placement=placement, keep_hidden=False)
            self.variants.append((step, (params, kv, table), replicated))

    def cost(self, bucket, builder) -> tuple[float | None, float | None]:
        figures = []
        for step, state, replicated in self.variants:
            f, b = _cost(lower_bucket(step, builder, bucket, state, replicated, cache_formats=self.formats).compile())
            if f is None or b is None:
                return None, None
            figures.append((f, b))
        (f1, b1), (f2, b2) = figures
        periods = (self.num_layers - 2 * self.period) / self.period
        return f1 + periods * (f2 - f1), b1 + periods * (b2 - b1)


def _draft_model_programs(draft: ModelConfig, shapes: RunnerShapes, *, dtype, backend, layer_loop, device,
                          peak, bandwidth, progress, rows_kernel: str = "jnp") -> dict:
    """The draft model's runner (engine/core/builder.py build_draft_proposer: the target's buckets
    and block tables, one more token bucket for rows catching up, one logit row per sequence)."""
    draft_shapes = dataclasses.replace(
        shapes, token_buckets=(*shapes.token_buckets, shapes.token_buckets[-1] + shapes.max_num_seqs),
        num_logprobs=0, logits_per_seq=1, sample_vocab_size=min(shapes.sample_vocab_size, draft.vocab_size),
        prompt_scoring=False, num_sliding_blocks=0)  # one group over the target's global tables
    params, replicated, kv_sharding, kv_config = _abstract_params(draft, dtype, layer_loop, None, device)
    kv = _kv_leaf(kv_config, draft_shapes.num_blocks, draft_shapes.block_size, dtype, backend, kv_sharding)
    table = table_state_spec(draft_shapes)
    table = with_sharding(table, jax.tree.map(lambda _: replicated, table))
    step = make_step(draft, draft_shapes, attention_backend=backend, interpret=False, layer_loop=layer_loop,
                     placement=None, keep_hidden=False)
    results = _compile_buckets(step, draft_shapes, draft_shapes.all_buckets(), (params, (kv, kv), table),
                               replicated, layer_loop=layer_loop, num_layers=draft.num_layers, peak=peak,
                               bandwidth=bandwidth, progress=progress, label="draft bucket",
                               pin_cache=pins_cache_layout(backend), rows_kernel=rows_kernel)
    return {"method": "draft_model", "model": draft.name,
            "weights_bytes": tree_bytes_per_device(params), "kv_cache_bytes": 2 * nbytes(kv),
            "table_bytes": tree_bytes_per_device(table),
            "programs": [{"program": "draft step", "padded_tokens": r.padded_tokens, "padded_seqs": r.padded_seqs,
                          "compile_s": r.compile_s, "temp_bytes": r.temp_bytes, "error": r.error}
                         for r in results]}


def save(build: Build, folder: str) -> None:
    """The build's executables and manifest, for a server's --load_executables."""
    compiled = {Bucket(b.padded_tokens, b.padded_seqs, b.padded_logits): b.executable
                for b in build.buckets}
    save_executables(folder, {**build.manifest, "target": build.target}, compiled)
