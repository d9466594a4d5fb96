"""GGUF checkpoints: metadata -> ModelConfig, tensors dequantized through the `gguf` package.

llama.cpp stores the Q and K projections of "llama" models (Mixtral included) with each head's
rows permuted for its interleaved RoPE; `unpermute_rows` restores the rotate-half layout our RoPE
(and HF) use. The other architectures (qwen2, qwen3, qwen3moe, gemma2, gemma3) are stored
unpermuted. A layer's tensors are those its config implies (`layer_tensors`): q/k norms
(attn_q_norm, attn_k_norm), Gemma's post-norms (post_attention_norm, post_ffw_norm; its
norms hold 1 + w, models/gguf_config.py), the router and stacked experts (ffn_gate_inp,
ffn_{gate,up,down}_exps [E, out, in]) instead of the MLP; a tensor left over is an error. Every
problem raises an error that names the file and what is wrong with it.

`native_blocks=True` keeps the tables (token_embd, an untied output) that the file stores as Q8_0
in that format: a models/quant.QuantizedWeight of int8 values [rows, cols] and one float32 scale
per 32 values [rows, cols / 32] (each block's float16 d), read from the raw bytes (34 per block:
d, then 32 int8) with no float copy made; the products and lookups dequantize inside. Other
tensors (the layers' matrices: the default model's are Q4_1) are still dequantized to `dtype`.
"""

from __future__ import annotations

import os

import numpy as np
from tqdm.auto import tqdm

from models.gguf_config import config_from_gguf
from models.quant import QuantizedWeight
from models.weights import layer_from_matrices, to_device, unpermute_rows

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


Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # values per block; bytes per block (float16 d, 32 x int8)


def q8_0_weight(path: str, tensor, dtype: str) -> QuantizedWeight:
    """A Q8_0 tensor [rows, cols] as int8 values and float32 block scales [rows, cols / 32]."""
    rows, cols = (int(n) for n in reversed(tensor.shape))
    raw = np.asarray(tensor.data).reshape(-1)
    if cols % Q8_0_BLOCK or raw.size != rows * cols // Q8_0_BLOCK * Q8_0_BYTES:
        raise ValueError(f"{path}: Q8_0 tensor {tensor.name} holds {raw.size} bytes, expected "
                         f"{rows * cols // Q8_0_BLOCK * Q8_0_BYTES} for [{rows}, {cols}]")
    blocks = raw.view(np.uint8).reshape(rows, cols // Q8_0_BLOCK, Q8_0_BYTES)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return QuantizedWeight(q, scale, dtype_name=dtype, block=Q8_0_BLOCK)


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
    native_blocks: Q8_0 tables stay Q8_0 (module docstring)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(path, reader)
    # llama.cpp permutes Q/K rows for its "llama" architecture only (Mixtral included): the
    # others (qwen2/3, gemma) use the rotate-half (NEOX) RoPE and are stored as in the checkpoint.
    # (gguf_config has refused a file without general.architecture.)
    permute = reader.fields["general.architecture"].contents() == "llama"
    suffixes = layer_tensors(config)

    def get(tensor_name: str) -> np.ndarray:
        if tensor_name not in tensors:
            raise ValueError(f"{path}: missing tensor {tensor_name}")
        return _dequantize(path, tensors[tensor_name])

    bar = tqdm(total=len(tensors), desc=f"loading {os.path.basename(path)}", unit="tensor",
               disable=not progress, leave=False)
    layers = []
    for i in range(config.num_layers):
        m = {}
        for suffix, ours in suffixes.items():
            full = f"blk.{i}.{suffix}"
            if full in tensors:
                m[ours] = get(full)
                bar.update(1)
        if permute:
            for key, heads in (("q", config.num_heads), ("k", config.num_kv_heads),
                               ("q_bias", config.num_heads), ("k_bias", config.num_kv_heads)):
                if key in m:
                    m[key] = unpermute_rows(m[key], heads)
        layers.append(to_device(layer_from_matrices(config, m, f"{path}: layer {i}"), dtype, host=host))
    native = {}  # Q8_0 tables kept as they are (native_blocks)

    def table(name: str, key: str):
        if native_blocks and name in tensors and tensors[name].tensor_type.name == "Q8_0":
            native[key] = q8_0_weight(path, tensors[name], dtype)
            return native[key]
        return get(name)

    params = {"embed": table("token_embd.weight", "embed"), "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        out = table("output.weight", "output_proj")  # served out-major: [vocab, hidden]
        if not isinstance(out, QuantizedWeight):
            params["lm_head"] = out.T
    used = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    used.update(f"blk.{i}.{suffix}" for i in range(config.num_layers) for suffix in suffixes)
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{path}: tensor {left[0]} is not used by the {config.architecture} "
                         f"metadata ({len(left)} unused tensor(s)); the metadata and the weights disagree")
    embed_shape = (config.vocab_size, config.hidden_size)
    if params["embed"].shape != embed_shape:
        raise ValueError(f"{path}: token_embd.weight has shape {params['embed'].shape}, expected {embed_shape}")
    params = to_device({k: v for k, v in params.items() if k not in native}, dtype, host=host)
    place = np.asarray if host else _to_device_array
    params.update({k: QuantizedWeight(place(w.q), place(w.scale), w.dtype_name, block=w.block)
                   for k, w in native.items()})
    params["layers"] = layers
    bar.close()
    return config, params, reader
