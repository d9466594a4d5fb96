"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by (1 + w), embeddings times sqrt(hidden), GeGLU
(tanh GELU), a norm before and after attention and the MLP, softmax scale
query_pre_attn_scalar^-1/2, interleaved sliding-window and global layers; Gemma 2 soft-caps the
attention and final logits, Gemma 3 norms q and k per head and gives local layers their own
RoPE base (rope_local_base_freq / the sliding_attention entry of rope_parameters)."""

from models.families.base import (
    DENSE_SHARDING,
    LLAMA_TENSORS,
    QK_NORM_SHARDING,
    QK_NORM_TENSORS,
    Family,
)

_TENSORS = {**{k: v for k, v in LLAMA_TENSORS.items() if "bias" not in k},
            # Gemma's post_attention_layernorm follows attention; the MLP's pre-norm is its own.
            "post_attention_layernorm.weight": "post_attn_norm",
            "pre_feedforward_layernorm.weight": "mlp_norm",
            "post_feedforward_layernorm.weight": "post_mlp_norm"}
_SHARDING = {**DENSE_SHARDING, "post_attn_norm": None, "post_mlp_norm": None}
_FIELDS = frozenset({"query_pre_attn_scalar", "hidden_activation", "use_bidirectional_attention",
                     "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq",
                     "final_logit_softcapping", "attn_logit_softcapping"})


def _refuse(field, value, why):
    return ValueError(f"config.json: {field}={value!r} is not supported: {why}")


def _common(config: dict, softcaps: bool) -> dict:
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise _refuse("hidden_activation", act, "Gemma's MLP is GeGLU with the tanh GELU "
                      "(gelu_pytorch_tanh)")
    if config.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "a causal LM attends causally")
    out = dict(norm_offset=1.0, embed_scale=True, hidden_act="gelu_tanh", sandwich_norms=True,
               query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)))
    for field, ours, default in (("attn_logit_softcapping", "attn_logit_softcap", 50.0),
                                 ("final_logit_softcapping", "final_logit_softcap", 30.0)):
        value = config.get(field, default if softcaps else None)
        if value is not None:
            out[ours] = float(value)
    return out


def default_layer_types(config: dict, model_type: str, num_layers: int) -> list[str]:
    """transformers' interleaving when config.json has no layer_types (transformers 4)."""
    if model_type == "gemma2":
        period = 2
    else:
        period = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


FAMILIES = {
    "gemma2": Family("gemma2", ("Gemma2ForCausalLM",), max_position_embeddings=8192, rms_norm_eps=1e-6,
                     sliding_window=4096, mixed_layers=True, fields=_FIELDS,
                     read=lambda config: _common(config, softcaps=True), tensors=_TENSORS,
                     sharding=_SHARDING, activations=("gelu_pytorch_tanh", "gelu_tanh")),
    "gemma3_text": Family("gemma3_text", ("Gemma3ForCausalLM",), max_position_embeddings=131072,
                          rms_norm_eps=1e-6, sliding_window=4096, mixed_layers=True, fields=_FIELDS,
                          read=lambda config: dict(_common(config, softcaps=False), qk_norm=True),
                          tensors={**_TENSORS, **QK_NORM_TENSORS},
                          sharding={**_SHARDING, **QK_NORM_SHARDING},
                          activations=("gelu_pytorch_tanh", "gelu_tanh")),
}
