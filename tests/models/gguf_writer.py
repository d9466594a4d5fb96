"""Writes small GGUF files the way llama.cpp's converter (convert_hf_to_gguf.py, gguf 0.19.0)
does, from our loader-layout parameters (for loader tests): Llama-family, Qwen3, Qwen3-MoE,
Gemma 2/3 and Mixtral (the "llama" architecture with stacked experts). The converter's
conventions: Q/K rows permuted for "llama" only; Gemma's norm weights stored with 1 added; the
experts of a layer stacked into one [E, out, in] tensor per projection; each family's keys."""

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

from models.weights import permute_rows

# ModelConfig.architecture -> the GGUF architecture the converter writes.
GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama"}


def hf_matrices(params, config):
    """Our parameter layout back to HF [out, in] matrices, keyed by GGUF tensor name (norms as
    the checkpoint holds them: without Gemma's + 1)."""
    e = config.hidden_size
    out = {"token_embd.weight": np.asarray(params["embed"], np.float32),
           "output_norm.weight": np.asarray(params["final_norm"], np.float32)}
    if "lm_head" in params:
        out["output.weight"] = np.asarray(params["lm_head"], np.float32).T
    for i, layer in enumerate(params["layers"]):
        g = lambda k, layer=layer: np.asarray(layer[k], np.float32)
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": g("attn_norm"),
            b + "attn_q.weight": g("wq").reshape(e, -1).T,
            b + "attn_k.weight": g("wk").reshape(e, -1).T,
            b + "attn_v.weight": g("wv").reshape(e, -1).T,
            b + "attn_output.weight": g("wo").reshape(-1, e).T,
            b + "ffn_norm.weight": g("mlp_norm"),
        })
        if config.num_experts:
            gate, up = np.split(g("experts_gate_up"), 2, axis=1)
            out.update({b + "ffn_gate_inp.weight": g("router"), b + "ffn_gate_exps.weight": gate,
                        b + "ffn_up_exps.weight": up, b + "ffn_down_exps.weight": g("experts_down")})
        else:
            out.update({b + "ffn_gate.weight": g("w_gate").T, b + "ffn_up.weight": g("w_up").T,
                        b + "ffn_down.weight": g("w_down").T})
        if config.qk_norm:
            out.update({b + "attn_q_norm.weight": g("q_norm"), b + "attn_k_norm.weight": g("k_norm")})
        if config.sandwich_norms:
            out.update({b + "post_attention_norm.weight": g("post_attn_norm"),
                        b + "post_ffw_norm.weight": g("post_mlp_norm")})
    return out


def _metadata(writer, config, arch):
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch != "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's default, 10 000)
        writer.add_rope_freq_base(config.rope_theta)
    if arch in ("llama", "mistral", "qwen2"):
        writer.add_rope_dimension_count(config.head_dim)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.num_experts:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.expert_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcap)
        writer.add_final_logit_softcapping(config.final_logit_softcap)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3" and config.rope_scaling is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)


def write_gguf(path, config, params, qtype=GGMLQuantizationType.F32, arch=None, raw=None, extra=None):
    """Writes params (our layout) as a GGUF; 2-D and 3-D weights in `qtype`, norms in F32.

    arch: the GGUF architecture (default: the converter's for config.architecture).
    raw: optional {tensor name: (uint8 bytes [rows, row_bytes], qtype)} written as given.
    extra: optional {key: (value, GGUFValueType)} added to the metadata as given.
    Returns {tensor name: the float32 array the file decodes to (before un-permuting)}.
    """
    arch = arch or GGUF_ARCH[config.architecture]
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, config, arch)
    for key, (value, vtype) in (extra or {}).items():
        writer.add_key_value(key, value, vtype)
    decoded = {}
    for name, w in hf_matrices(params, config).items():
        if name.endswith("norm.weight") and arch in ("gemma2", "gemma3"):
            w = w + np.float32(1.0)  # Gemma's RMSNorm scales by 1 + w; the converter stores 1 + w
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = permute_rows(w, config.num_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
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
