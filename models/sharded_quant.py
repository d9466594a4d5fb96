"""Quantized weights on a mesh: the per-shard served layout of models/sharding.py quantized as one
device quantizes its weights (models/quant.py), each weight's scales placed with its output dim.

1. What and how: the same matrices and the same scheme as `quantize_params` (symmetric, one
   float32 scale per output channel, i.e. per row of the out-major [o, i] weight), applied to the
   padded, per-shard fused layout after it is placed (`Placement.place`, engine/step/placement.py)
   and before stacked 16-bit layers become bits. On a mesh each weight is quantized by one jitted
   program over the global array, so a row's max |w| is the max of the whole row even where its
   columns are split (XLA reduces across the shards): every scale and every value equals the
   one-device quantization of the same weight (padding is zero rows, scale 1 and values 0, or
   zero columns, which change no max). The float weight is dropped as its quantized copy is made.
2. Where the scales live (models/sharding.py `weight_spec`): a scale belongs to an output
   channel, so it is split as the weight's output dim is: with the rows of a column-parallel
   weight (qkv_proj, gate_up_proj: per-shard fused order), with the vocabulary (embed,
   output_proj), with the experts (experts_gate_up / experts_down); replicated for a row-parallel
   weight (o_proj, down_proj), whose output dim is whole on every device.
3. An expert's down_proj whose MLP width is split m = tp / ep ways is held as m separate blocks
   of the leading axis (models/sharding.py `_shard_experts`): its max runs over the m blocks of
   the expert group (`quantize_with_amax`), so the scale is still the whole row's.
4. Products (models/quant.py QuantizedWeight.product) run on each device's shard, unchanged, and
   the step keeps the Megatron pattern (2 all-reduces per layer). A column-parallel product sees
   the whole input row, so its dynamic activation scale (the int8 x int8 / fp8 x fp8 form) is one
   device's; a row-parallel product sees its slice of the input, and each device scales its own
   slice (a scale per row and shard, as vLLM's row-parallel layers do) rather than reducing the
   row's max across the devices (one more all-reduce per product). So in the weight-only form
   TP > 1 equals TP = 1 to float rounding; with quantized activations the row-parallel products
   round differently (finer) than one device does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.quant import (
    QUANTIZATIONS,
    QUANTIZED_LAYER_WEIGHTS,
    QUANTIZED_TABLES,
    quantize_weight,
    quantize_with_amax,
)
from models.served_layout import pack_layer_bits
from models.sharding import TPLayout, param_specs, shard_params_host, weight_spec


def quantize_array(w: jax.Array, *, method: str, activation_rows: int | None,
                   expert_split: tuple[int, int] | None = None):
    """One out-major weight [..., o, i] -> QuantizedWeight. expert_split (ep, m): w is experts_down
    in the sharded layout [..., ep * m * E_local, e, f / m] and a row's max runs over its m blocks."""
    if expert_split is None or expert_split[1] == 1:
        return quantize_weight(w, method, activation_rows=activation_rows)
    ep, m = expert_split
    *lead, n, e, f = w.shape
    blocks = jnp.abs(w.astype(jnp.float32)).reshape(*lead, ep, m, n // (ep * m), e, f)
    amax = jnp.max(blocks, axis=(-4, -1), keepdims=True)[..., 0]  # [..., ep, 1, E_local, e]
    amax = jnp.broadcast_to(amax, (*lead, ep, m, n // (ep * m), e)).reshape(*lead, n, e)
    return quantize_with_amax(w, amax, method, activation_rows=activation_rows)


def quantize_sharded(params: dict, layout: TPLayout, method: str | None, *,
                     activation_rows: int | None = None, mesh=None, config: ModelConfig | None = None) -> dict:
    """The sharded served layout with float values (shard_params_host(pack_bits=False)), placed on
    `mesh` (or traced, mesh None) -> its weight matrices quantized (module docstring), then its
    stacked 16-bit layers packed as bits. Takes `params` over: its dicts are updated in place, so
    each float weight is freed once quantized. method None only packs."""
    if method is None:
        return pack_layer_bits(params)
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    specs = param_specs(params, config) if mesh is not None else None
    programs: dict = {}

    def quantize(name: str, w, spec):
        split = (layout.ep, layout.tp // layout.ep) if name == "experts_down" else None
        fn = functools.partial(quantize_array, method=method, activation_rows=activation_rows, expert_split=split)
        if mesh is None:
            return fn(w)
        out = jax.tree.map(lambda s: NamedSharding(mesh, s), weight_spec(spec, jax.eval_shape(fn, w)),
                           is_leaf=lambda x: isinstance(x, P))
        key = (split, out)
        if key not in programs:
            programs[key] = jax.jit(fn, out_shardings=out)
        return programs[key](w)

    for name in QUANTIZED_TABLES[method]:
        if name in params:
            params[name] = quantize(name, params[name], specs and specs[name])
    layers = params["layers"]
    for i, layer in enumerate(layers if isinstance(layers, list) else [layers]):
        layer_specs = None
        if specs is not None:
            layer_specs = specs["layers"][i] if isinstance(layers, list) else specs["layers"]
        for name in QUANTIZED_LAYER_WEIGHTS:
            if name in layer:
                layer[name] = quantize(name, layer[name], layer_specs and layer_specs[name])
    return pack_layer_bits(params)


def abstract_quantized_params(config: ModelConfig, layout: TPLayout, *, dtype: str, stack: bool,
                              quantization: str | None, activation_rows: int | None = None) -> dict:
    """The ShapeDtypeStructs of the quantized sharded weights (`models.sharding.abstract_sharded_params`
    with `quantize_sharded` after; no memory used)."""
    from models.random_weights import random_params

    def build():
        host = shard_params_host(random_params(config, dtype=dtype), config, layout, dtype=dtype,
                                 stack=stack, xp=jnp, pack_bits=False)
        return quantize_sharded(host, layout, quantization, activation_rows=activation_rows)

    return jax.eval_shape(build)
