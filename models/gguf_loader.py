"""GGUF checkpoints: metadata -> ModelConfig, tensors dequantized through the `gguf` package.

llama.cpp stores the Q and K projections of "llama" models (Mixtral included) with each head's
rows permuted for its interleaved RoPE; `unpermute_rows` restores the rotate-half layout our RoPE
(and HF) use. The other architectures (qwen2, qwen3, qwen3moe, gemma2, gemma3) are stored
unpermuted. A layer's tensors are those its config implies (`layer_tensors`): q/k norms
(attn_q_norm, attn_k_norm), Gemma's post-norms (post_attention_norm, post_ffw_norm; its
norms hold 1 + w, models/gguf_config.py), the router and stacked experts (ffn_gate_inp,
ffn_{gate,up,down}_exps [E, out, in]) instead of the MLP; a tensor left over is an error. Every
problem raises an error that names the file and what is wrong with it.

`native_blocks=True` (EngineConfig.quantization="gguf") serves the file's Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K tensors in their own blocks (models/gguf_blocks.py):
the tables (token_embd, an untied output) and, for a dense model, the layers' products, read from
the raw bytes into models/quant.QuantizedWeight (int8 codes, float32 scales per 32 values (Q2_K,
Q3_K, Q6_K: 16), the minimums as offsets) with no float copy made; the products and lookups
dequantize inside. The layers then come in the served layout (models/served_layout.py: qkv_proj,
o_proj, gate_up_proj, down_proj, bqkv), since a fused product of block weights is built from the
file's rows; a product is served in blocks when all its parts are of those types (mixed among them
is fine: at 16-value blocks where any part, in any layer, is Q2_K, Q3_K or Q6_K, so the layers
stack), else in float as before.
Left in float (dequantized to `dtype`, logged once per file when a quantized type is among them):
a product with a part in F32/F16/BF16 (its quantized parts too), and a mixture of experts' layers.
The IQ and TQ types are not in SUPPORTED_TYPES: refused by name, with or without native_blocks.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import jax
import numpy as np
from tqdm.auto import tqdm

from models.gguf_blocks import (
    BLOCK,
    FUSED,
    NATIVE_TYPES,
    block_of,
    block_weight,
    served_products,
    unpermute_weight,
    with_block,
)
from models.gguf_config import config_from_gguf
from models.quant import QuantizedWeight
from models.weights import layer_from_matrices, to_device, unpermute_rows

log = logging.getLogger(__name__)

# Tensor types we dequantize (all through gguf.quants, which is numpy-vectorized).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF per-layer tensor names -> the names `layer_from_matrices` expects, by what the config has.
_ATTENTION = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm",
}
_BIASES = {"attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias"}
_QK_NORM = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
# Gemma: ffn_norm is the MLP's pre-norm (pre_feedforward_layernorm), as for the others.
_SANDWICH = {"post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm"}
_MLP = {"ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down"}
# Experts stacked [E, out, in] (the file's shape reversed), the router [E, e].
_EXPERTS = {"ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts_gate",
            "ffn_up_exps.weight": "experts_up", "ffn_down_exps.weight": "experts_down"}


def layer_tensors(config) -> dict[str, str]:
    """The per-layer tensors (GGUF suffix -> our name) a file of this config holds."""
    names = {**_ATTENTION, **(_EXPERTS if config.num_experts else _MLP)}
    for present, group in ((config.attention_bias, _BIASES), (config.qk_norm, _QK_NORM),
                           (config.sandwich_norms, _SANDWICH)):
        if present:
            names.update(group)
    return names


def open_gguf(path: str | os.PathLike):
    """The parsed GGUF file (text/gguf_file.GGUFFile); every failure is an error naming the file:
    FileNotFoundError, or a ValueError saying "not a GGUF file" / "truncated or corrupted"."""
    from text.tokenizer import open_gguf as open_checked

    return open_checked(path)


def gguf_metadata(reader) -> dict:
    """Scalar and string fields as Python values (the big token/merge arrays are left out)."""
    meta = {key: field.contents() for key, field in reader.fields.items()
            if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                           "tokenizer.ggml.token_type")}
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"]))
    return meta


def _to_device_array(x):
    import jax.numpy as jnp

    return jnp.asarray(x)


def _dequantize(path: str, tensor) -> np.ndarray:
    from gguf import quants

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name} has unsupported type {type_name} "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    expected = tuple(int(n) for n in reversed(tensor.shape))
    try:
        arr = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ValueError(f"{path}: tensor {tensor.name} cannot be decoded ({e})") from None
    arr = np.asarray(arr, dtype=np.float32)
    if arr.size != int(np.prod(expected)):
        raise ValueError(f"{path}: tensor {tensor.name} is truncated ({arr.size} values, expected {expected})")
    return arr.reshape(expected)


def gguf_config(path: str, reader):
    """The file's ModelConfig (metadata, plus the rope_freqs tensor where llama3 scaling is baked
    in); errors name the file."""
    tensors = {t.name: t for t in reader.tensors}
    meta = gguf_metadata(reader)
    name = str(meta.get("general.name") or os.path.basename(path))
    rope_freqs = _dequantize(path, tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    try:
        return config_from_gguf(meta, name=name, tensor_names=set(tensors), rope_freqs=rope_freqs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32", progress: bool = True,
              host: bool = False, native_blocks: bool = False):
    """Returns (ModelConfig, params, reader); params are on the default device in `dtype`.
    native_blocks: tensors of models/gguf_blocks.NATIVE_TYPES stay in their blocks, the layers in the served layout
    (module docstring)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(path, reader)
    # llama.cpp permutes Q/K rows for its "llama" architecture only (Mixtral included): the
    # others (qwen2/3, gemma) use the rotate-half (NEOX) RoPE and are stored as in the checkpoint.
    # (gguf_config has refused a file without general.architecture.)
    permute = reader.fields["general.architecture"].contents() == "llama"
    suffixes = layer_tensors(config)
    served = native_blocks and not config.num_experts  # layers built in the served layout
    dequantized = Counter()  # quantized layer tensors with no block form, by type (native_blocks)

    def get(tensor_name: str) -> np.ndarray:
        if tensor_name not in tensors:
            raise ValueError(f"{path}: missing tensor {tensor_name}")
        kind = tensors[tensor_name].tensor_type.name
        if native_blocks and kind not in ("F32", "F16", "BF16", "F64"):
            dequantized[kind] += 1
        return _dequantize(path, tensors[tensor_name])

    def native_parts(i: int) -> set[str]:
        """Our names of layer i's tensors read in blocks: the parts of every served product whose
        parts are all of NATIVE_TYPES."""
        ours = {v: f"blk.{i}.{k}" for k, v in suffixes.items()}
        return {p for parts in FUSED.values() if all(p in ours and ours[p] in tensors and
                                                     tensors[ours[p]].tensor_type.name in NATIVE_TYPES for p in parts)
                for p in parts} if served else set()

    # Each served product at the finest block any layer's parts have (16 beside 32), so
    # the layers stack (a scan over stacked layers needs one block per product).
    finest = {served_name: min([block_of(tensors[f"blk.{i}.{k}"].tensor_type.name)
                                for i in range(config.num_layers) for k, v in suffixes.items()
                                if v in parts and f"blk.{i}.{k}" in tensors] or [BLOCK])
              for served_name, parts in FUSED.items()} if served else {}

    bar = tqdm(total=len(tensors), desc=f"loading {os.path.basename(path)}", unit="tensor",
               disable=not progress, leave=False)
    layers = []
    for i in range(config.num_layers):
        m, natives, blocks = {}, {}, native_parts(i)
        for suffix, ours in suffixes.items():
            full = f"blk.{i}.{suffix}"
            if ours in blocks:
                natives[ours] = block_weight(path, tensors[full], dtype)
            elif full in tensors:
                m[ours] = get(full)
            bar.update(full in tensors)
        if permute:
            for key, heads in (("q", config.num_heads), ("k", config.num_kv_heads),
                               ("q_bias", config.num_heads), ("k_bias", config.num_kv_heads)):
                if key in natives:
                    natives[key] = unpermute_weight(natives[key], heads)
                elif key in m:
                    m[key] = unpermute_rows(m[key], heads)
        where = f"{path}: layer {i}"
        layer = _served_layer(config, m, natives, where) if served else layer_from_matrices(config, m, where)
        layer = {k: with_block(w, finest[k]) if isinstance(w, QuantizedWeight) else w for k, w in layer.items()}
        layers.append(_place(layer, dtype, host))

    def table(name: str):  # in its blocks (native_blocks) where it has a block form
        if native_blocks and name in tensors and tensors[name].tensor_type.name in NATIVE_TYPES:
            return block_weight(path, tensors[name], dtype)
        return get(name)

    params = {"embed": table("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        out = table("output.weight")  # a block weight is served out-major as stored: [vocab, hidden]
        params.update({"output_proj": out} if isinstance(out, QuantizedWeight) else {"lm_head": out.T})
    used = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    used.update(f"blk.{i}.{suffix}" for i in range(config.num_layers) for suffix in suffixes)
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{path}: tensor {left[0]} is not used by the {config.architecture} "
                         f"metadata ({len(left)} unused tensor(s)); the metadata and the weights disagree")
    embed_shape = (config.vocab_size, config.hidden_size)
    if params["embed"].shape != embed_shape:
        raise ValueError(f"{path}: token_embd.weight has shape {params['embed'].shape}, expected {embed_shape}")
    params = _place(params, dtype, host)
    params["layers"] = layers
    bar.close()
    if dequantized:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items()))
        why = ("a mixture of experts' layers are served in float" if config.num_experts else
               f"fused with a part in float, or of a type with no block form here (only {'/'.join(NATIVE_TYPES)})")
        log.warning("%s: quantization='gguf': %s tensors dequantized to %s (%s)", path, kinds, dtype, why)
    return config, params, reader


def _served_layer(config, m: dict, natives: dict, where: str) -> dict:
    """One layer in the served layout (models/served_layout.py) from its HF-layout float tensors
    `m` and block weights `natives` (models/gguf_blocks.py)."""
    e, d = config.hidden_size, config.head_dim
    layer = served_products(natives, m, config, where)
    norms = {"attn_norm": e, "mlp_norm": e, "q_norm": d, "k_norm": d, "post_attn_norm": e, "post_mlp_norm": e}
    for name, size in norms.items():
        if name in m:
            if m[name].shape != (size,):
                raise ValueError(f"{where}: tensor {name} has shape {m[name].shape}, expected {(size,)}")
            layer[name] = m[name]
    missing = {"attn_norm", "mlp_norm", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"} - set(layer)
    if missing:
        raise ValueError(f"{where}: missing tensor for {sorted(missing)[0]}")
    return layer


def _place(tree: dict, dtype: str, host: bool) -> dict:
    """Float leaves cast to `dtype` and placed (models/weights.to_device); block weights placed
    as they are (int8 codes, float32 scales)."""
    blocks = {k: v for k, v in tree.items() if isinstance(v, QuantizedWeight)}
    out = to_device({k: v for k, v in tree.items() if k not in blocks}, dtype, host=host)
    place = np.asarray if host else _to_device_array
    out.update({k: jax.tree.map(place, w) for k, w in blocks.items()})
    return out

