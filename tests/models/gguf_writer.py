"""Writes small Llama-family GGUF files the way llama.cpp's converter does (for loader tests)."""

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from models.weights import permute_rows


def hf_matrices(params, config):
    """Our parameter layout back to HF [out, in] matrices, keyed by GGUF tensor name."""
    e = config.hidden_size
    out = {"token_embd.weight": np.asarray(params["embed"], np.float32),
           "output_norm.weight": np.asarray(params["final_norm"], np.float32)}
    if "lm_head" in params:
        out["output.weight"] = np.asarray(params["lm_head"], np.float32).T
    for i, layer in enumerate(params["layers"]):
        g = lambda k, layer=layer: np.asarray(layer[k], np.float32)
        out.update({
            f"blk.{i}.attn_norm.weight": g("attn_norm"),
            f"blk.{i}.attn_q.weight": g("wq").reshape(e, -1).T,
            f"blk.{i}.attn_k.weight": g("wk").reshape(e, -1).T,
            f"blk.{i}.attn_v.weight": g("wv").reshape(e, -1).T,
            f"blk.{i}.attn_output.weight": g("wo").reshape(-1, e).T,
            f"blk.{i}.ffn_norm.weight": g("mlp_norm"),
            f"blk.{i}.ffn_gate.weight": g("w_gate").T,
            f"blk.{i}.ffn_up.weight": g("w_up").T,
            f"blk.{i}.ffn_down.weight": g("w_down").T,
        })
    return out


def write_gguf(path, config, params, qtype=GGMLQuantizationType.F32, arch="llama", raw=None):
    """Writes params (our layout) as a GGUF; 2-D weights in `qtype`, norms in F32.

    raw: optional {tensor name: (uint8 bytes [rows, row_bytes], qtype)} written as given.
    Returns {tensor name: the HF-layout float32 array the file decodes to (before un-permuting)}.
    """
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    decoded = {}
    for name, w in hf_matrices(params, config).items():
        if name.endswith("attn_q.weight"):
            w = permute_rows(w, config.num_heads)
        elif name.endswith("attn_k.weight"):
            w = permute_rows(w, config.num_kv_heads)
        if raw and name in raw:
            data, t = raw[name]
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)
            if t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
                decoded[name] = quants.dequantize(data, t).reshape(w.shape)
        elif w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
            decoded[name] = w
        else:
            q = quants.quantize(np.ascontiguousarray(w), qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
            decoded[name] = quants.dequantize(q, qtype).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded
