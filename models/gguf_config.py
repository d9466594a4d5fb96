"""GGUF metadata -> ModelConfig, read strictly.

llama.cpp writes a model's hyperparameters under the architecture's namespace (`llama.*`,
`qwen3.*`, `gemma2.*`). Every key there is read (`_READ` and the architecture's own keys in
`_ARCH_READ`), ignored because it does not change the forward pass (`_IGNORED`), or refused by
name: LayerNorm instead of RMSNorm, RoPE over part of a head, YaRN, logit or residual scales,
shared experts, sigmoid gating, and any key this reader does not know (a new llama.cpp key is a
hyperparameter until shown otherwise). A key that llama.cpp does not read for the architecture
but that would change the computation is accepted only with the value llama.cpp assumes.

What llama.cpp fixes rather than stores is applied as llama.cpp applies it (gguf 0.19.0's
converter, llama.cpp's llama_model::load_hparams):
- "llama" with `expert_count` > 0 is Mixtral: softmax router, top `expert_used_count`,
  renormalized (llama.cpp passes norm_w = true); experts stacked as ffn_{gate,up,down}_exps.
- "qwen3moe" always renormalizes its top-k weights (Qwen3-MoE's norm_topk_prob; a file cannot
  say false); the expert width is `expert_feed_forward_length`.
- "gemma2" / "gemma3": the converter stores every RMSNorm weight with 1 added (Gemma's 1 + w),
  so the config scales by the stored weight (norm_offset 0). The softmax scale is
  query_pre_attn_scalar^-1/2 with that scalar hidden / heads for the 27B shapes (46 layers for
  Gemma 2, 62 for Gemma 3) and head_dim otherwise. Layers slide in llama.cpp's pattern: every
  second layer global (Gemma 2), every sixth (Gemma 3); Gemma 3's sliding layers use RoPE base
  10 000 unscaled, its global ones `rope.freq_base` with the file's linear scaling. Gemma 2's
  soft caps default to 50 (attention) and 30 (final), its window to 4096.

Llama 3 scaling is not in the metadata: llama.cpp's converter bakes it into a `rope_freqs.weight`
tensor (one divisor per rotary frequency). That tensor is checked against the llama3 formula with
the factor it implies and Llama 3's ramp (low 1, high 4, original context 8192, or the file's
`rope.scaling.original_context_length`); a file whose factors follow another rule is refused.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig, RopeScaling

# GGUF architecture -> ModelConfig.architecture ("llama" with experts is "mixtral").
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                 "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

_READ = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length",
}
_MOE_READ = {"expert_count", "expert_used_count"}
# Keys only some architectures read (the Gemma ones checked against llama.cpp's fixed values).
_ARCH_READ = {
    "llama": _MOE_READ,
    "qwen3moe": _MOE_READ | {"expert_feed_forward_length"},
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "attention.scale",
               "attention.sliding_window_pattern"},
    "gemma3": {"final_logit_softcapping", "attention.scale", "attention.sliding_window_pattern",
               "rope.freq_base_swa"},
}
# Whether the model was fine-tuned at the scaled context: metadata only.
_IGNORED = {"rope.scaling.finetuned"}
# Keys that are refused unless they hold the value that changes nothing (for a mixture of
# experts: what llama.cpp runs these architectures with).
_NEUTRAL = {
    "expert_count": 0, "expert_used_count": 0, "attention.causal": True,
    "rope.scaling.attn_factor": 1.0, "attention.clamp_kqv": 0.0, "logit_scale": 1.0,
    "residual_scale": 1.0, "embedding_scale": 1.0, "expert_shared_count": 0,
    "expert_shared_feed_forward_length": 0, "expert_weights_scale": 1.0,
    "expert_weights_norm": True, "expert_gating_func": 1, "leading_dense_block_count": 0,
}
_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern: every p-th layer global
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    """The divisor llama3 scaling applies to each inverse frequency (as llama.cpp stores it)."""
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    ramp = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, ramp))


def _rope_scaling(get, rope_theta: float, head_dim: int, rope_freqs) -> RopeScaling | None:
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type == "linear":
        if rope_freqs is not None:
            raise ValueError("GGUF has both rope.scaling.type 'linear' and a rope_freqs.weight tensor")
        return RopeScaling("linear", float(get("rope.scaling.factor")))
    if scaling_type not in ("", "none"):
        raise ValueError(f"GGUF metadata rope.scaling.type={scaling_type!r} is not supported "
                         "(supported: none, linear; llama3 as a rope_freqs.weight tensor)")
    if rope_freqs is None:
        return None
    rope_freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope_freqs.shape != inv_freq.shape:
        raise ValueError(f"GGUF tensor rope_freqs.weight has {rope_freqs.size} values, expected "
                         f"{inv_freq.size} (head_dim / 2)")
    factor = float(rope_freqs.max())
    original = int(get("rope.scaling.original_context_length", 8192))
    expected = _llama3_factors(inv_freq, factor, 1.0, 4.0, original)
    if not np.allclose(rope_freqs, expected, rtol=1e-3):
        raise ValueError("GGUF tensor rope_freqs.weight does not follow llama3 scaling (factor "
                         f"{factor:g}, low_freq_factor 1, high_freq_factor 4, original context "
                         f"{original}); other per-frequency factors are not supported")
    return RopeScaling("llama3", factor, 1.0, 4.0, original)


def _check_keys(meta: dict, arch: str) -> None:
    prefix = f"{arch}."
    own = _ARCH_READ.get(arch, set())
    for full in sorted(k for k in meta if k.startswith(prefix)):
        key = full[len(prefix):]
        if key in _READ or key in _IGNORED or key in own:
            continue
        if key in _NEUTRAL and meta[full] == _NEUTRAL[key]:
            continue
        raise ValueError(f"GGUF metadata {full}={meta[full]!r} is not supported by jaxserve's "
                         f"{arch} (it changes the computation)")


def _moe_fields(arch: str, get, tensor_names: set[str]) -> dict:
    """Mixtral ("llama" with experts) and Qwen3-MoE: the routed experts."""
    experts = int(get("expert_count", 0))
    if not experts:
        if arch == "qwen3moe":
            raise ValueError("GGUF metadata qwen3moe.expert_count is missing or 0")
        return {}
    if any(".ffn_gate.0." in name for name in tensor_names):
        raise ValueError("GGUF has one tensor per expert (blk.N.ffn_gate.J.weight, llama.cpp's "
                         "layout before April 2024); convert the model again for stacked "
                         "ffn_{gate,up,down}_exps tensors")
    out = dict(architecture="mixtral", num_experts=experts,
               num_experts_per_tok=int(get("expert_used_count")), norm_topk_prob=True)
    if arch == "qwen3moe":
        out.update(architecture="qwen3_moe", qk_norm=True,
                   moe_intermediate_size=int(get("expert_feed_forward_length")))
    return out


def _gemma_fields(meta: dict, arch: str, get, num_layers: int, hidden: int, num_heads: int,
                  head_dim: int, rope_theta: float, rope_scaling) -> dict:
    """Gemma 2 and 3 as llama.cpp runs them (see the module docstring)."""
    out = dict(norm_offset=0.0, embed_scale=True, hidden_act="gelu_tanh", sandwich_norms=True)
    scalar = hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    out["query_pre_attn_scalar"] = float(scalar)
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None and abs(float(scale) - scalar ** -0.5) > 1e-6 * scalar ** -0.5:
        raise ValueError(f"GGUF metadata {arch}.attention.scale={scale!r}: llama.cpp runs {arch} with "
                         f"1/sqrt({scalar}) (hidden / heads for the 27B shape, else the head "
                         "dimension) and ignores this key; a file that disagrees is not supported")
    if arch == "gemma2":
        out["attn_logit_softcap"] = float(get("attn_logit_softcapping", 50.0))
        out["final_logit_softcap"] = float(get("final_logit_softcapping", 30.0))
        window = int(get("attention.sliding_window", 4096))
        local_theta, local_scaling = rope_theta, rope_scaling
    else:
        cap = float(meta.get(f"{arch}.final_logit_softcapping", 0.0))
        if cap:
            out["final_logit_softcap"] = cap
        window = int(meta.get(f"{arch}.attention.sliding_window", 0))
        local_theta, local_scaling = 10000.0, None
        swa_base = meta.get(f"{arch}.rope.freq_base_swa")
        if swa_base is not None and float(swa_base) != local_theta:
            raise ValueError(f"GGUF metadata {arch}.rope.freq_base_swa={swa_base!r}: llama.cpp runs "
                             "gemma3's sliding layers with RoPE base 10000 and ignores this key")
    if not window:  # llama.cpp's gemma3 without a window: every layer global
        return out
    period = _GEMMA_PERIOD[arch]
    kinds = tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention"
                  for i in range(num_layers))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and pattern != period and (
            not isinstance(pattern, list) or [bool(p) for p in pattern] != [k == "sliding_attention" for k in kinds]):
        raise ValueError(f"GGUF metadata {arch}.attention.sliding_window_pattern={pattern!r}: llama.cpp "
                         f"runs {arch} with every {period}th layer global and ignores this key")
    return dict(out, sliding_window=window, layer_types=kinds, local_rope_theta=local_theta,
                local_rope_scaling=local_scaling)


def config_from_gguf(meta: dict, name: str, tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """`meta` maps GGUF keys (e.g. "llama.block_count") to Python values; `rope_freqs` is the
    `rope_freqs.weight` tensor's values when the file has one (llama3 scaling)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in tensor_names and rope_freqs is None:
        raise ValueError("GGUF has a rope_freqs.weight tensor; pass its values (rope_freqs=)")
    _check_keys(meta, arch)
    prefix = f"{arch}."

    def get(key, default=None):
        full = prefix + key
        if full in meta:
            return meta[full]
        if default is None:
            raise ValueError(f"GGUF metadata lacks {full!r}")
        return default

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"GGUF metadata {prefix}attention.value_length={value_dim} differs from the "
                         f"key length {head_dim}: not supported")
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"GGUF metadata {prefix}rope.dimension_count={rotary} is not the head "
                         f"dimension {head_dim}: RoPE over part of each head is not supported")
    vocab = meta.get(prefix + "vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", ()))
    num_layers = int(get("block_count"))
    rope_theta = float(get("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(get, rope_theta, head_dim, rope_freqs)
    fields = dict(architecture=ARCHITECTURES[arch], qk_norm=arch in ("qwen3", "gemma3"))
    fields.update(_moe_fields(arch, get, tensor_names))
    if arch in _GEMMA_PERIOD:
        fields.update(_gemma_fields(meta, arch, get, num_layers, hidden, num_heads, head_dim,
                                    rope_theta, rope_scaling))
    else:
        window = meta.get(prefix + "attention.sliding_window")
        fields["sliding_window"] = int(window) if window else None
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        **fields,
    )
