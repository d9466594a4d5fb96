"""The llama family's parameter layouts: the loaders' one and the one the engine serves.

The loaders (models/weights.py, the GGUF / HF / orbax / random loaders) give one dict per layer,
in-major ([in, out...]): wq [e, h, d], wk / wv [e, k, d], wo [h, d, e], w_gate / w_up [e, f],
w_down [f, e], an untied lm_head [e, v] (models/llama.py's docstring has the axes).
What the engine serves (`fuse_projections`, built once at load; models/sharding.py builds the
same per shard): q/k/v and gate/up fused, every projection one out-major matrix, as in Hugging
Face checkpoints; on a scan over stacked layers (`stack_layers`), a 16-bit model's layers kept
as their bits (`pack_layer_bits`). models/llama.py runs either layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write import as_bits, from_bits


def stack_layers(params: dict) -> dict:
    """The per-layer list of parameter dicts as one dict of arrays stacked on a layer axis."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    # (tree.map: a quantized weight, models/quant.py, stacks its codes and scales alike)
    stacked = {name: jax.tree.map(lambda *xs: jnp.stack(xs), *[layer[name] for layer in layers])
               for name in layers[0]}
    return {**params, "layers": stacked}


def served_layer(layer: dict, xp=jnp) -> dict:
    """One loader-layout layer (or a stack of them: a leading layer axis) in the served layout:
    q/k/v and gate/up fused, every projection one out-major matrix (see the module docstring).
    The heads may come already fused in the loaders' in-major layout as wqkv [(n,) e, heads, d]
    (and bqkv [(n,) heads, d]), and gate/up as w_gate_up [(n,) e, 2 * f], in a caller's own order
    (models/sharding.py: shard after shard). `xp` is jnp or numpy (sharding builds shards on the
    host). Idempotent."""
    if "qkv_proj" in layer:
        return layer
    fused = ("wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down",
             "bq", "bk", "bv", "bqkv")
    out = {k: v for k, v in layer.items() if k not in fused}
    wqkv = layer.get("wqkv")
    if wqkv is None:
        wqkv = xp.concatenate([layer["wq"], layer["wk"], layer["wv"]], axis=-2)
    lead = wqkv.shape[:-3]  # () or (n,)
    flat_qkv = xp.reshape(wqkv, lead + (wqkv.shape[-3], -1))  # [(n,) e, heads * d]
    out["qkv_proj"] = xp.swapaxes(flat_qkv, -1, -2)
    out["o_proj"] = xp.swapaxes(xp.reshape(layer["wo"], lead + (-1, layer["wo"].shape[-1])), -1, -2)
    gate_up = layer.get("w_gate_up")
    if gate_up is None and "w_gate" in layer:
        gate_up = xp.concatenate([layer["w_gate"], layer["w_up"]], axis=-1)
    if gate_up is not None:  # a mixture of experts keeps its (already out-major) expert weights
        out["gate_up_proj"] = xp.swapaxes(gate_up, -1, -2)  # [(n,) e, 2f] -> [(n,) 2f, e]
        out["down_proj"] = xp.swapaxes(layer["w_down"], -1, -2)  # [(n,) f, e] -> [(n,) e, f]
    bqkv = layer.get("bqkv")
    if bqkv is None and "bq" in layer:
        bqkv = xp.concatenate([layer["bq"], layer["bk"], layer["bv"]], axis=-2)
    if bqkv is not None:
        out["bqkv"] = xp.reshape(bqkv, lead + (-1,))
    if xp is not jnp:
        out = {k: xp.ascontiguousarray(v) for k, v in out.items()}
    return out


def fuse_projections(params: dict) -> dict:
    """The loaders' layout -> the served one (`served_layer` per layer, a list of layers or a
    stacked dict; an untied lm_head [e, v] -> output_proj [v, e]). Idempotent."""
    layers = params["layers"]
    out = {k: v for k, v in params.items() if k != "lm_head"}
    out["layers"] = [served_layer(x) for x in layers] if isinstance(layers, list) else served_layer(layers)
    if "lm_head" in params:
        out["output_proj"] = jnp.swapaxes(params["lm_head"], 0, 1)
    return out


def pack_layer_bits(params: dict) -> dict:
    """Stacked 16-bit layer weights stored as their bits (uint16; `unpack_layer` reads them as the
    embedding's dtype). Under lax.scan XLA:CPU would otherwise convert every stacked bfloat16
    weight to float32 outside the loop, every step, only to slice one layer of it."""
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    # (tree.map: a quantized weight, models/quant.py, is its int8/fp8 values and float32 scales)
    return {**params, "layers": {name: jax.tree.map(as_bits, w) for name, w in layers.items()}}


def unpack_layer(layer: dict, dtype) -> dict:
    """One layer's weights back from bits (inside the scan body, after the slice: free)."""
    return {name: from_bits(w, dtype) if w.dtype == jnp.uint16 else w for name, w in layer.items()}


def num_layers_of(params: dict) -> int:
    layers = params["layers"]
    return len(layers) if isinstance(layers, list) else layers["attn_norm"].shape[0]
