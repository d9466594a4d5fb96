"""GGUF metadata -> ModelConfig, read strictly.

llama.cpp writes a model's hyperparameters under the architecture's namespace (`llama.*`,
`qwen2.*`). Every key there is read (`_READ`), ignored because it does not change the forward pass
(`_IGNORED`), or refused by name: MoE expert counts, LayerNorm instead of RMSNorm, soft-capping,
RoPE over part of a head, YaRN, logit or residual scales, and any key this reader does not know
(a new llama.cpp key is a hyperparameter until shown otherwise).

Llama 3 scaling is not in the metadata: llama.cpp's converter bakes it into a `rope_freqs.weight`
tensor (one divisor per rotary frequency). That tensor is checked against the llama3 formula with
the factor it implies and Llama 3's ramp (low 1, high 4, original context 8192, or the file's
`rope.scaling.original_context_length`); a file whose factors follow another rule is refused.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig, RopeScaling

# The architectures whose GGUF tensors and metadata this reader maps (the Llama family's); the
# newer families load from Hugging Face folders.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_READ = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length",
}
# Whether the model was fine-tuned at the scaled context: metadata only.
_IGNORED = {"rope.scaling.finetuned"}
# Keys that are refused unless they hold the value that changes nothing.
_NEUTRAL = {
    "expert_count": 0, "expert_used_count": 0, "attention.causal": True,
    "rope.scaling.attn_factor": 1.0, "attention.clamp_kqv": 0.0, "logit_scale": 1.0,
    "residual_scale": 1.0, "embedding_scale": 1.0,
}


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
    prefix = f"{arch}."
    for full in sorted(k for k in meta if k.startswith(prefix)):
        key = full[len(prefix):]
        if key in _READ or key in _IGNORED:
            continue
        if key in _NEUTRAL and meta[full] == _NEUTRAL[key]:
            continue
        raise ValueError(f"GGUF metadata {full}={meta[full]!r} is not supported by jaxserve's "
                         f"{arch} (it changes the computation)")

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
    rope_theta = float(get("rope.freq_base", 10000.0))
    window = meta.get(prefix + "attention.sliding_window")
    return ModelConfig(
        name=name,
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(get, rope_theta, head_dim, rope_freqs),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(window) if window else None,
    )
