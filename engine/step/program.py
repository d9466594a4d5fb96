"""The compiled step as a program: what ModelRunner compiles, described without device arrays.

ModelRunner holds live arrays (weights, KV cache, request table) and compiles a step per bucket
against their shapes. The same description, with abstract state on other devices (compile-only
TPU or GPU devices, experiments/aot.py), builds the programs a target would run, so what is
compiled for a target is what the server compiles:

1. `make_step`: the step function (the forward on one device or under shard_map on a mesh, then
   the sampler), with every static choice the runner makes (backend, layer loop, logprobs,
   drafts, hidden rows).
2. `served_params_spec`: the served weights' shapes and dtypes (fused, stacked, 16-bit as bits on
   a stacked loop; padded and fused per shard on a mesh), traced with `jax.eval_shape`, so
   nothing the size of the model is allocated.
3. `kv_cache_spec` (kv_cache.py) and `table_state_spec`: the cache's and the request table's.
4. `lower_bucket`: one bucket's step lowered against that state, the cache and the table donated
   (on the TPU the cache's layout pinned to the kernels', `pins_cache_layout`).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from engine.step.buckets import Bucket, RunnerShapes
from engine.step.placement import Placement
from engine.step.request_table import allocate_table_state
from engine.step.sampler import sample
from engine.step.step_inputs import BatchBuilder, StepLayout
from models import weight_first
from models.config import ModelConfig
from models.llama import forward_paged
from models.quant import hold_code_sums, quantize_params
from models.random_weights import random_params
from models.served_layout import fuse_projections, pack_layer_bits, stack_layers
from models.sharded_quant import abstract_quantized_params
from models.sharding import abstract_sharded_params
from pallas_kernels import kv_layout_for, xla_forms


def serve_layout(params: dict, layer_loop: str, quantization: str | None = None,
                 activation_rows: int | None = None) -> dict:
    """Loader-layout params (on one device) -> what the single-device runner serves (quantized
    before the stacked 16-bit layers become bits: models/quant.py quantizes float values)."""
    stacked = stack_layers(params) if layer_loop == "stacked" else params
    served = quantize_params(fuse_projections(stacked), quantization, activation_rows=activation_rows)
    if layer_loop == "switch":  # the CPU's loop: int8 products with their code sums (models/int8_dot.py)
        served = hold_code_sums(served)
    return pack_layer_bits(served)


def served_params_spec(config: ModelConfig, *, dtype: str, layer_loop: str,
                       placement: Placement | None, quantization: str | None = None,
                       activation_rows: int | None = None, smoothing: bool = False) -> dict:
    """ShapeDtypeStructs (no sharding) of the weights the runner would serve for `config`
    (quantized as ModelRunner quantizes them, models/quant.py; `smoothing`: smoothed first,
    models/smoothing.py, which gives a tied embedding its factors)."""
    if placement is None:
        def served():
            params = random_params(config, dtype=dtype)
            if smoothing and quantization is not None and "lm_head" not in params:
                params["embed_smoothing"] = jnp.ones((config.hidden_size,), jnp.float32)
            return serve_layout(params, layer_loop, quantization, activation_rows)

        return jax.eval_shape(served)
    if quantization is not None:
        return abstract_quantized_params(config, placement.layout, dtype=dtype, stack=layer_loop == "stacked",
                                         quantization=quantization, activation_rows=activation_rows)
    return abstract_sharded_params(config, placement.layout, dtype=dtype, stack=layer_loop == "stacked")


def table_state_spec(shapes: RunnerShapes):
    return jax.eval_shape(lambda: allocate_table_state(shapes.max_num_seqs, shapes.sample_vocab_size))


def _forward_plain(params, kv_cache, inputs, *, config, **kwargs):
    return forward_paged(params, config, kv_cache, inputs, **kwargs)


def make_step(config: ModelConfig, shapes: RunnerShapes, *, attention_backend: str, interpret: bool,
              layer_loop: str, placement: Placement | None, keep_hidden: bool, lora_method: str = "masked"):
    """The step (params, kv_cache, table, flat, token_mask, *, layout) -> (kv_cache, table,
    packed[, hidden]) for one model on one device (placement None) or a mesh."""
    if placement is None:
        forward = functools.partial(_forward_plain, config=config, attention_backend=attention_backend,
                                    interpret=interpret, scan_layers=layer_loop != "unrolled",
                                    return_hidden=keep_hidden, lora_method=lora_method,
                                    kv_layout=kv_layout_for(attention_backend))
    else:
        if keep_hidden:
            raise ValueError("ModelRunner(keep_hidden=True) runs on one device (no placement)")
        forward = placement.forward(attention_backend=attention_backend, interpret=interpret,
                                    layer_loop=layer_loop, lora_method=lora_method)
    hidden_rows = shapes.max_logits if keep_hidden else 0
    return functools.partial(_step, forward=forward, num_logprobs=shapes.num_logprobs,
                             sample_vocab_size=shapes.sample_vocab_size,
                             num_speculative_tokens=shapes.logits_per_seq - 1, hidden_rows=hidden_rows)


def pins_cache_layout(attention_backend: str) -> bool:
    """Whether the steps pin the KV cache's layout to the kernels' (`lower_bucket` cache_formats):
    on the TPU, where XLA otherwise gives the cache parameter a layout of its own whenever its
    minor dims do not fill a tile (2-3 kv heads, head_dim 64) and copies the whole cache into the
    Mosaic kernels' layout at each step's entry and back at its exit (docs/tpu_gpu.md)."""
    return attention_backend == "pallas_tpu"


def auto_cache_formats(abstract_cache):
    """The cache's formats with the layout left to XLA (`Layout.AUTO`), on each array's sharding:
    the first bucket's compile picks the kernels' layout, and its `input_formats` are then the
    cache's (ModelRunner allocates the cache in them; every later bucket is compiled for them)."""
    return jax.tree.map(lambda leaf: Format(Layout.AUTO, leaf.sharding), abstract_cache)


def laid_out_bytes(shape, dtype, fmt) -> int:
    """Bytes an array of `shape` takes in the device layout `fmt` (a jax Format; None: dense):
    its dims in the layout's major-to-minor order, the minor ones padded to the first tile (a
    TPU's (sublanes, 128 lanes)). On the TPU the kernels' cache layout pads a small kv-head count
    and a head_dim under 128 (the default model's [.., 3, 64] in (4, 128) tiles: 2.67x)."""
    layout = getattr(fmt, "layout", None)
    dims = [int(d) for d in shape]
    tiling = getattr(layout, "tiling", None) or ()
    if layout is not None and getattr(layout, "major_to_minor", None) is not None:
        dims = [dims[i] for i in layout.major_to_minor]
    if tiling and tiling[0] and len(tiling[0]) <= len(dims):
        tile = tiling[0]
        dims[-len(tile):] = [-(-d // t) * t for d, t in zip(dims[-len(tile):], tile)]
    return int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize


def cache_bytes(cache, formats) -> tuple[int, int]:
    """(laid out, plain) bytes per device of a cache (arrays or ShapeDtypeStructs) in `formats` (its
    pytree of Formats, e.g. a compiled step's input_formats for it)."""
    leaves = jax.tree.leaves(cache)
    shapes = [a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
              for a in leaves]
    laid = sum(laid_out_bytes(s, a.dtype, f) for a, s, f in
               zip(leaves, shapes, jax.tree.leaves(formats, is_leaf=lambda x: isinstance(x, Format)), strict=True))
    return laid, sum(laid_out_bytes(s, a.dtype, None) for a, s in zip(leaves, shapes))


def pin_cache_layout(kv_cache, compiled):
    """(formats, a zeroed cache in them): the cache's layout as `compiled` (a bucket's step
    compiled with "auto" formats) takes it. Called at the first compile, before any step has
    written the cache: the old one is freed first and the new one allocated in place of it, never
    both at once (a relayout would hold both). Warns when that layout pads the cache: a pool sized
    from the memory budget counts the padding (engine/step/tpu_cache_layout.py), an explicit
    num_kv_blocks does not."""
    formats = compiled.input_formats[0][1]
    laid, plain = cache_bytes(kv_cache, formats)
    if laid > 1.05 * plain:
        logging.warning("jaxserve: the TPU kernels' layout pads the KV cache to %.2f GiB per device, %.2fx its "
                        "%.2f GiB of values and scales (a pool sized from the memory budget counts this; an "
                        "explicit num_kv_blocks does not: docs/tpu_gpu.md)", laid / 2**30, laid / plain, plain / 2**30)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), kv_cache)
    for a in jax.tree.leaves(kv_cache):
        a.delete()
    zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract), out_shardings=formats)
    return formats, zeros()


def lower_bucket(step, builder: BatchBuilder, bucket: Bucket, abstract_state, input_sharding=None,
                 cache_formats=None, product_forms: dict | None = None, rows_kernel: str = "jnp"):
    """The bucket's step lowered against (params, kv_cache, table) shapes; cache and table donated.
    cache_formats (`pins_cache_layout`): the cache's input and output formats, "auto"
    (`auto_cache_formats`) or the concrete ones a compile chose (equal in and out: the donated
    cache stays in place). product_forms: the CPU's float product forms by (dtype, rows)
    (engine/step/product_forms.py), None: the static rule. rows_kernel: how the xla path's
    one-token rows run (pallas_kernels/xla_forms.py ROWS_KERNELS)."""
    if isinstance(cache_formats, str) and cache_formats == "auto":
        cache_formats = auto_cache_formats(abstract_state[1])
    layout = builder.layout(bucket.padded_tokens, bucket.padded_seqs, bucket.padded_logits)
    lora = {} if bucket.lora_rank is None else {"lora_rank": bucket.lora_rank}
    pinned = {}
    if cache_formats is not None:
        outputs = 4 if step.keywords.get("hidden_rows") else 3  # (kv_cache, table, packed[, hidden])
        pinned = dict(in_shardings=(None, cache_formats, None, None, None),
                      out_shardings=(cache_formats, *(None,) * (outputs - 1)))
    jitted = jax.jit(functools.partial(step, layout=layout, **lora), donate_argnums=(1, 2), **pinned)
    flat = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=input_sharding)
    mask = jax.ShapeDtypeStruct(layout.mask.shape, np.int32, sharding=input_sharding)
    # traced here, in whichever thread compiles
    with weight_first.product_forms(product_forms), xla_forms.rows_kernel(rows_kernel):
        return jitted.lower(*abstract_state, flat, mask)


def _step(params, kv_cache, table, flat, token_mask, *, layout: StepLayout, forward, num_logprobs,
          sample_vocab_size, num_speculative_tokens, hidden_rows=0, lora_rank=None):
    inputs = layout.unpack(flat, token_mask)
    table = table.with_joins(inputs.join_slots, inputs.join_values())
    # lora_rank: the bucket's LoRA rank (RunnerShapes.lora_ranks, one device only); None: all of it
    lora = {} if lora_rank is None else {"lora_rank": lora_rank}
    kv_cache, logits, *hidden = forward(params, kv_cache, inputs, **lora)
    # A checkpoint may pad its vocabulary past the tokenizer's: those ids are never sampled.
    table, packed = sample(logits[:, :sample_vocab_size], inputs, table, num_logprobs=num_logprobs,
                           num_speculative_tokens=num_speculative_tokens)
    if hidden_rows:  # the final hidden state at the logit rows, padded to a fixed row count
        return kv_cache, table, packed, jnp.pad(hidden[0], ((0, hidden_rows - hidden[0].shape[0]), (0, 0)))
    return kv_cache, table, packed
