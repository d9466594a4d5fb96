"""Tensor parallelism for the llama family: the sharding rules, head padding, shard-by-shard placement.

The Megatron pattern over the mesh axis "model" (size tp):
- q/k/v (fused qkv_proj) and gate/up (fused gate_up_proj) are split by output heads / columns,
  o_proj and down_proj by their input heads / rows, so each device computes its own heads'
  attention and its own slice of the MLP, and one all-reduce (psum) after o_proj and one after
  down_proj per layer rebuild the residual stream. (The served layout is out-major:
  models/llama.py.)
- embed [v, e] and output_proj [v, e] are split by vocabulary: the embedding lookup is a masked local
  gather plus one all-reduce per step, the logits one all-gather per step (the sampler then sees
  the full vocabulary, replicated).
- norms are replicated; the KV cache is split on its KV-head axis.
- quantized weights (models/quant.py QuantizedWeight; made on the mesh by models/sharded_quant.py):
  the values split as the float weight, the per-output-channel scales as its output dim
  (`weight_spec`); an 8-bit cache's values and scales both on KV heads (`kv_cache_specs`).

Head counts that tp does not divide are PADDED, not replicated: the KV heads go up to the next
multiple of tp, and every padded KV head gets its group of g = h / k padded query heads (so GQA
grouping stays per shard). Padded heads have zero q/k/v weights and zero wo rows: their K/V are
zeros, their attention output is a mean of zero V, and wo multiplies it by zero rows, so they add
exactly nothing. Cost (the default model, 9 q / 3 KV heads): at tp = 2 or 4, 12 q / 4 KV heads,
i.e. +33 % attention weights (wqkv, wo), +33 % KV cache bytes and attention FLOPs; the MLP and
the embeddings are not padded unless f or v is not a multiple of tp (then zero columns / rows,
padded logits are never sampled: the sampler cuts at the tokenizer's vocabulary).

The fused layout is built per shard on the host: qkv_proj's head axis holds, shard after shard,
that shard's q heads, then its k heads, then its v heads ([tp * (h/tp + 2k/tp), d, e]), so a
plain split of axis "model" hands each device exactly the fused qkv_proj of its own heads. Weights are
placed with `jax.make_array_from_callback`: each device receives only its slice from host memory,
never a full copy on device 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.quant import QuantizedWeight
from models.served_layout import served_layer
from pallas_kernels.kv_quant import ScaledCache
from pallas_kernels.kv_write import as_bits

MODEL_AXIS = "model"

# How a family's sharding table (models/families/) splits a parameter -> its PartitionSpec
# (served, fused layout; one layer, no layer axis).
SPEC_OF_SPLIT: dict = {
    None: None,  # replicated (the spec's rank is the array's)
    "vocab": P(MODEL_AXIS, None),  # [v, e] by vocabulary
    "heads": P(MODEL_AXIS, None),  # qkv_proj [(h + 2k) * d, e] by heads (per-shard fused order)
    "heads_in": P(None, MODEL_AXIS),  # o_proj [e, h * d] by input heads
    "mlp": P(MODEL_AXIS, None),  # gate_up_proj [2 * f, e] by rows (per-shard gate, then up)
    "mlp_in": P(None, MODEL_AXIS),  # down_proj [e, f] by input columns
    # Experts [tp * E_local, ...]: device i holds its expert group's experts (group i // (tp/ep))
    # with its slice (i % (tp/ep)) of their MLP width, laid out device after device.
    "experts_mlp": P(MODEL_AXIS, None, None),
    "experts_mlp_in": P(MODEL_AXIS, None, None),
}
# Parameter name (served, fused layout; one layer, no layer axis) -> PartitionSpec.
LLAMA_RULES: dict[str, P] = {
    "embed": P(MODEL_AXIS, None),  # [v, e] by vocabulary
    "output_proj": P(MODEL_AXIS, None),  # [v, e] by vocabulary
    "final_norm": P(None),
    "attn_norm": P(None),
    "mlp_norm": P(None),
    "qkv_proj": P(MODEL_AXIS, None),  # [(h + 2k) * d, e] by heads (per-shard fused order)
    "bqkv": P(MODEL_AXIS),  # [(h + 2k) * d]
    "o_proj": P(None, MODEL_AXIS),  # [e, h * d] by input heads
    "gate_up_proj": P(MODEL_AXIS, None),  # [2 * f, e] by rows (per-shard gate, then up)
    "down_proj": P(None, MODEL_AXIS),  # [e, f] by input columns
    "q_norm": P(None), "k_norm": P(None), "post_attn_norm": P(None), "post_mlp_norm": P(None),
    "router": P(None, None),  # [E, e] replicated: every device routes every token
    "experts_gate_up": SPEC_OF_SPLIT["experts_mlp"],
    "experts_down": SPEC_OF_SPLIT["experts_mlp_in"],
}
KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS, None)  # [L, num_blocks, block_size, Hkv, D]
KV_PAGE_SCALES_SPEC = P(None, None, MODEL_AXIS)  # the TPU's page layout [L, num_blocks, W]: a piece per shard


def kv_cache_spec(kv_layout: str = "token_major") -> P:
    """The cache's values split on KV heads: KV_CACHE_SPEC, or with head-major pages (the xla
    path's, pallas_kernels/validation.KV_LAYOUTS) [L, num_blocks, Hkv, block_size, D] on axis 2."""
    return P(None, None, MODEL_AXIS, None, None) if kv_layout == "head_major" else KV_CACHE_SPEC


def kv_cache_specs(kv_cache: tuple, kv_layout: str = "token_major") -> tuple:
    """The specs of a (k_cache, v_cache) pair: split on KV heads, an 8-bit cache's values and
    scales alike (pallas_kernels/kv_quant.py ScaledCache: per-token scales are the values' shape
    without D; the page layout's rows in one piece per shard, each its heads' scales)."""
    values = kv_cache_spec(kv_layout)
    scales = {"token": P(*values[:4]), "page": KV_PAGE_SCALES_SPEC}
    return tuple(dataclasses.replace(c, values=values, scales=scales[c.layout])
                 if isinstance(c, ScaledCache) else values for c in kv_cache)


def weight_spec(spec: P, w) -> P | QuantizedWeight:
    """A weight's spec; a quantized weight's (models/quant.py) is a QuantizedWeight of specs:
    the values split as the float weight they replace, the per-output-channel scales [..., o] as
    its output dim (split with a column-parallel weight's rows, the vocabulary or the experts;
    replicated for a row-parallel weight, whose output dim is whole on every device)."""
    if isinstance(w, QuantizedWeight):
        return dataclasses.replace(w, q=spec, scale=P(*tuple(spec)[:-1]))
    return spec

# How the adapter buffers split over the mesh axis "model", matching the base layer (Megatron):
# column-parallel q/k/v and gate/up: B by its output rows (per-shard fused order, as qkv_proj and
# gate_up_proj), A replicated; row-parallel o/down: A by its input columns, B replicated, so each
# device's partial delta joins the base product's partial sum in the same all-reduce.
LORA_SPLITS = {"qkv_proj": ("b", 1), "gate_up_proj": ("b", 1), "o_proj": ("a", 3), "down_proj": ("a", 3)}


def lora_partition_specs(buffers: dict, axis: str) -> dict:
    out = {}
    for product, ab in buffers.items():
        which, dim = LORA_SPLITS[product]
        out[product] = {k: P(*[axis if (k == which and i == dim) else None for i in range(4)]) for k in ab}
    return out




@dataclasses.dataclass(frozen=True)
class TPLayout:
    """The padded global sizes of a model split tp ways; `local` is one shard's ModelConfig."""

    tp: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    local: ModelConfig  # the shape each device's forward sees (its heads, its MLP and vocab slices)
    padded: ModelConfig  # the global shape after padding (what the KV cache is allocated for)
    ep: int = 1  # expert groups: experts split ep ways, each expert's MLP width tp / ep ways
    expert_size: int = 0  # each expert's MLP width, padded to a multiple of tp / ep


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tp_layout(config: ModelConfig, tp: int, ep: int = 1) -> TPLayout:
    """ep > 1 (expert parallelism, a mixture of experts only): the tp devices form ep expert
    groups of tp / ep devices; attention, the embeddings and the head stay split tp ways."""
    if ep != 1 and (not config.num_experts or tp % ep or config.num_experts % ep):
        raise ValueError(f"EngineConfig.expert_parallel_size={ep} must divide tensor_parallel_size="
                         f"{tp} and the model's num_experts ({config.num_experts}; a mixture of "
                         "experts only)")
    k = _round_up(config.num_kv_heads, tp)
    h = k * (config.num_heads // config.num_kv_heads)
    f = _round_up(config.intermediate_size, tp)
    v = _round_up(config.vocab_size, tp)
    moe = {}
    fe = 0
    if config.num_experts:
        fe = _round_up(config.expert_size, tp // ep)
        moe = dict(moe_intermediate_size=fe // (tp // ep))
    local = dataclasses.replace(config, num_heads=h // tp, num_kv_heads=k // tp,
                                intermediate_size=f // tp, vocab_size=v // tp, **moe)
    padded = dataclasses.replace(config, num_heads=h, num_kv_heads=k, intermediate_size=f, vocab_size=v,
                                 **(dict(moe_intermediate_size=fe) if fe else {}))
    return TPLayout(tp, h, k, f, v, local, padded, ep, fe)


def partition_spec(name: str, *, stacked: bool) -> P:
    spec = LLAMA_RULES[name]
    return P(None, *spec) if stacked else spec


def _spec(name: str, a, table: dict | None, stacked: bool = False) -> P | QuantizedWeight:
    if table is None:
        return weight_spec(partition_spec(name, stacked=stacked), a)
    split = table[name]
    if split is None:
        return weight_spec(P(*([None] * a.ndim)), a)
    spec = SPEC_OF_SPLIT[split]
    return weight_spec(P(None, *spec) if stacked else spec, a)


def param_specs(params: dict, config: ModelConfig | None = None) -> dict:
    """The PartitionSpec pytree matching a served (fused) parameter pytree: by the family's
    sharding table (models/families/) given the config, else by the shared names (LLAMA_RULES)."""
    table = None
    if config is not None:
        from models.families import FAMILIES

        table = FAMILIES[config.architecture].sharding
    layers = params["layers"]
    top = {name: _spec(name, a, table) for name, a in params.items() if name not in ("layers", "lora")}
    if "lora" in params:  # LoRA adapter slots (models/lora.py), split as the layers they modify
        top["lora"] = lora_partition_specs(params["lora"], MODEL_AXIS)
    if isinstance(layers, list):
        return {**top, "layers": [{n: _spec(n, a, table) for n, a in layer.items()} for layer in layers]}
    return {**top, "layers": {n: _spec(n, a, table, stacked=True) for n, a in layers.items()}}


def _pad(a: np.ndarray, axis: int, size: int, xp=np) -> np.ndarray:
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return xp.pad(a, widths)


def _pad_heads(a: np.ndarray, axis: int, num_groups: int, group: int, padded_groups: int,
               xp=np) -> np.ndarray:
    """Pads a head axis of num_groups * group heads to padded_groups * group (whole GQA groups)."""
    shape = a.shape
    grouped = a.reshape(*shape[:axis], num_groups, group, *shape[axis + 1 :])
    grouped = _pad(grouped, axis, padded_groups, xp)
    return grouped.reshape(*shape[:axis], padded_groups * group, *shape[axis + 1 :])


def _fuse_per_shard(*parts: np.ndarray, axis: int, tp: int, xp=np) -> np.ndarray:
    """Arrays [.., n_i, ..] -> [.., tp * sum(n_i / tp), ..]: shard after shard, each shard's slice
    of every part in order (q, k, v heads; gate, up columns)."""
    splits = zip(*(xp.split(x, tp, axis=axis) for x in parts))
    return xp.concatenate([xp.concatenate(p, axis=axis) for p in splits], axis=axis)


def shard_layer_host(layer: dict, config: ModelConfig, layout: TPLayout, xp=np) -> dict:
    """One loader-layout layer (numpy) -> the served, padded, per-shard fused layer (numpy).
    xp=jnp does the same with jax.numpy, so `jax.eval_shape` gives the shapes without memory."""
    kv, g, kp, tp = config.num_kv_heads, config.num_heads // config.num_kv_heads, layout.num_kv_heads, layout.tp
    f = layout.intermediate_size
    q = _pad_heads(layer["wq"], 1, kv, g, kp, xp)
    k = _pad_heads(layer["wk"], 1, kv, 1, kp, xp)
    v = _pad_heads(layer["wv"], 1, kv, 1, kp, xp)
    small = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "router")
    fused = {name: layer[name] for name in small if name in layer}
    fused.update(wqkv=_fuse_per_shard(q, k, v, axis=1, tp=tp, xp=xp),
                 wo=_pad_heads(layer["wo"], 0, kv, g, kp, xp))
    if "w_gate" in layer:
        fused.update(w_gate_up=_fuse_per_shard(_pad(layer["w_gate"], 1, f, xp),
                                               _pad(layer["w_up"], 1, f, xp), axis=1, tp=tp, xp=xp),
                     w_down=_pad(layer["w_down"], 0, f, xp))
    else:
        fused.update(_shard_experts(layer, config, layout, xp))
    if "bq" in layer:
        fused["bqkv"] = _fuse_per_shard(_pad_heads(layer["bq"], 0, kv, g, kp, xp),
                                        _pad_heads(layer["bk"], 0, kv, 1, kp, xp),
                                        _pad_heads(layer["bv"], 0, kv, 1, kp, xp), axis=0, tp=tp, xp=xp)
    return served_layer(fused, xp=xp)


def _shard_experts(layer: dict, config: ModelConfig, layout: TPLayout, xp=np) -> dict:
    """experts_gate_up [E, 2f, e] / experts_down [E, e, f] -> [tp * E_local, 2 f_local, e] /
    [tp * E_local, e, f_local]: device i's block is expert group i // m (m = tp / ep) with MLP
    slice i % m (gate rows, then up rows), so a plain split of the leading axis places it."""
    tp, ep, fe = layout.tp, layout.ep, layout.expert_size
    m, n, f = tp // ep, config.num_experts, config.expert_size
    e_local, f_local = n // ep, fe // m
    gate_up = layer["experts_gate_up"]
    gate, up = _pad(gate_up[:, :f], 1, fe, xp), _pad(gate_up[:, f:], 1, fe, xp)
    down = _pad(layer["experts_down"], 2, fe, xp)
    blocks_gu, blocks_d = [], []
    for i in range(tp):
        experts = slice((i // m) * e_local, (i // m + 1) * e_local)
        cols = slice((i % m) * f_local, (i % m + 1) * f_local)
        blocks_gu.append(xp.concatenate([gate[experts, cols], up[experts, cols]], axis=1))
        blocks_d.append(down[experts, :, cols])
    return {"experts_gate_up": xp.concatenate(blocks_gu, axis=0),
            "experts_down": xp.concatenate(blocks_d, axis=0)}


def shard_lora_values(a: dict, b: dict, config: ModelConfig, layout: TPLayout) -> dict:
    """One adapter's host layout (LoRAWeights.a / .b, the model's own head counts) -> the padded,
    per-shard fused layout of models/sharding.py (TPLayout `layout`): padded heads and MLP columns
    get zero rows, q/k/v (gate/up) rows are laid out shard after shard."""
    kv, g, kp, tp, d = config.num_kv_heads, config.num_heads // config.num_kv_heads, layout.num_kv_heads, layout.tp, config.head_dim
    out = {}
    for product in a:
        a_p, b_p = a[product], b[product]
        n, r = a_p.shape[0], b_p.shape[-1]
        if product == "qkv_proj":
            q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
            parts = [b_p[:, :q_rows], b_p[:, q_rows : q_rows + kv_rows], b_p[:, q_rows + kv_rows :]]
            heads = [_pad_heads(x.reshape(n, -1, d, r), 1, kv, group, kp) for x, group in zip(parts, (g, 1, 1))]
            b_p = _fuse_per_shard(*heads, axis=1, tp=tp).reshape(n, -1, r)
        elif product == "gate_up_proj":
            f = config.intermediate_size
            b_p = _fuse_per_shard(_pad(b_p[:, :f], 1, layout.intermediate_size),
                                  _pad(b_p[:, f:], 1, layout.intermediate_size), axis=1, tp=tp)
        elif product == "o_proj":
            a_p = _pad_heads(a_p.reshape(n, a_p.shape[1], -1, d), 2, kv, g, kp).reshape(n, a_p.shape[1], -1)
        elif product == "down_proj":
            a_p = _pad(a_p, 2, layout.intermediate_size)
        out[product] = {"a": np.ascontiguousarray(a_p), "b": np.ascontiguousarray(b_p)}
    return out


def to_host(a, dtype) -> np.ndarray:
    """A loader's array (numpy, or a device array fetched one tensor at a time) in `dtype`."""
    a = np.asarray(jax.device_get(a))
    return a if a.dtype == jnp.dtype(dtype) else a.astype(np.float32).astype(jnp.dtype(dtype))


def shard_params_host(params: dict, config: ModelConfig, layout: TPLayout, *, dtype: str,
                      stack: bool, xp=np, pack_bits: bool = True) -> dict:
    """The whole served pytree on the host: padded, fused per shard, stacked (and as uint16 bits
    when stacked and 16-bit and `pack_bits`, as models/llama.pack_layer_bits would), ready to
    place. xp=jnp traces the same transform (`abstract_sharded_params`). pack_bits=False keeps
    float values for quantizing after placement (models/sharded_quant.py packs after)."""
    if xp is np:
        host = lambda a: to_host(a, dtype)  # noqa: E731
    else:
        host = lambda a: a.astype(jnp.dtype(dtype))  # noqa: E731
    layers = [shard_layer_host(jax.tree.map(host, layer), config, layout, xp) for layer in params["layers"]]
    out = {"embed": _pad(host(params["embed"]), 0, layout.vocab_size, xp),
           "final_norm": host(params["final_norm"])}
    if "lm_head" in params:
        head = _pad(host(params["lm_head"]), 1, layout.vocab_size, xp).T
        out["output_proj"] = np.ascontiguousarray(head) if xp is np else head
    if stack:
        stacked = {name: xp.stack([layer[name] for layer in layers]) for name in layers[0]}
        if pack_bits and jnp.dtype(dtype).itemsize == 2:
            bits = (lambda w: w.view(np.uint16)) if xp is np else as_bits
            stacked = {name: bits(w) for name, w in stacked.items()}
        out["layers"] = stacked
    else:
        out["layers"] = layers
    check_family_table(config, out)
    return out


def abstract_sharded_params(config: ModelConfig, layout: TPLayout, *, dtype: str, stack: bool) -> dict:
    """The ShapeDtypeStructs of `shard_params_host`'s result for `config` (no memory used)."""
    from models.random_weights import random_params

    return jax.eval_shape(lambda: shard_params_host(random_params(config, dtype=dtype), config,
                                                    layout, dtype=dtype, stack=stack, xp=jnp))


def place_params(host_params: dict, mesh, config: ModelConfig | None = None) -> dict:
    """Each device gets only its slice: make_array_from_callback reads the host array per shard
    (under jax.distributed, only this process's devices are filled)."""
    specs = param_specs(host_params, config)

    def place(a: np.ndarray, spec: P):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])

    return jax.tree.map(place, host_params, specs, is_leaf=lambda x: isinstance(x, np.ndarray))


def bytes_per_device(tree) -> dict:
    """{device: bytes of the tree's shards held there} (addressable devices only)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def check_family_table(config: ModelConfig, params: dict) -> None:
    """Every served parameter of the model is in its family's sharding table (models/families/)."""
    from models.families import FAMILIES

    table = FAMILIES[config.architecture].sharding
    layers = params["layers"]
    names = set(params) - {"layers"} | set(layers[0] if isinstance(layers, list) else layers)
    missing = sorted(names - set(table))
    if missing:
        raise ValueError(f"{config.architecture}'s sharding table (models/families/) has no rule for "
                         f"{', '.join(missing)}")


def forward_paged_sharded(params: dict, layout: TPLayout, kv_cache: tuple, batch, *, mesh,
                          attention_backend: str, interpret: bool = False, scan_layers: bool = False,
                          lora_method: str = "masked", kv_layout: str = "token_major"):
    """models/llama.forward_paged under shard_map over "model": every device runs its own heads
    (attention, whichever backend, on its local heads and its local KV-cache shard) and its MLP
    slice; returns the sharded cache and the full logits [L, v padded], replicated."""
    from models.llama import forward_paged

    cache_specs = kv_cache_specs(kv_cache, kv_layout)  # a (k, v) pair per cache group, 8-bit ones with scales

    def local(p, cache, b):
        return forward_paged(p, layout.local, cache, b, attention_backend=attention_backend,
                             interpret=interpret, tp_axis=MODEL_AXIS, scan_layers=scan_layers,
                             lora_method=lora_method, kv_layout=kv_layout)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(param_specs(params, layout.local), cache_specs, P()),
                           out_specs=(cache_specs, P()), check_vma=False)
    return mapped(params, kv_cache, batch)
