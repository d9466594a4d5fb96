"""GGUF checkpoints: metadata -> ModelConfig, tensors dequantized through the `gguf` package.

llama.cpp stores the Q and K projections of "llama" models (Mixtral included) with each head's
rows permuted for its interleaved RoPE; `unpermute_rows` restores the rotate-half layout our RoPE
(and HF) use. The other architectures (qwen2, qwen3, qwen3moe, gemma2, gemma3) are stored
unpermuted. A layer's tensors are those its config implies (`layer_tensors`): q/k norms
(attn_q_norm, attn_k_norm), Gemma's post-norms (post_attention_norm, post_ffw_norm; its
norms hold 1 + w, models/gguf_config.py), the router and stacked experts (ffn_gate_inp,
ffn_{gate,up,down}_exps [E, out, in]) instead of the MLP; a tensor left over is an error. Every
problem raises an error that names the file and what is wrong with it.
"""

from __future__ import annotations

import os

import numpy as np
from tqdm.auto import tqdm

from models.gguf_config import config_from_gguf
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


def meta_arch(reader) -> str | None:
    field = reader.fields.get("general.architecture")
    return None if field is None else field.contents()


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
              host: bool = False):
    """Returns (ModelConfig, params, reader); params are on the default device in `dtype`."""
    path = os.fspath(path)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(path, reader)
    # llama.cpp permutes Q/K rows for its "llama" architecture only (Mixtral included): the
    # others (qwen2/3, gemma) use the rotate-half (NEOX) RoPE and are stored as in the checkpoint.
    permute = meta_arch(reader) == "llama"
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
    params = {"embed": get("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("output.weight").T
    used = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    used.update(f"blk.{i}.{suffix}" for i in range(config.num_layers) for suffix in suffixes)
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{path}: tensor {left[0]} is not used by the {config.architecture} "
                         f"metadata ({len(left)} unused tensor(s)); the metadata and the weights disagree")
    embed_shape = (config.vocab_size, config.hidden_size)
    if params["embed"].shape != embed_shape:
        raise ValueError(f"{path}: token_embd.weight has shape {params['embed'].shape}, expected {embed_shape}")
    params = to_device(params, dtype, host=host)
    params["layers"] = layers
    bar.close()
    return config, params, reader
