"""Qwen3 (per-head RMSNorm on q and k before RoPE, no q/k/v bias) and Qwen3-MoE (the same
attention, a routed mixture of experts: softmax, top-k, renormalized when norm_topk_prob)."""

from models.families.base import (
    DENSE_SHARDING,
    LLAMA_TENSORS,
    MOE_SHARDING,
    QK_NORM_SHARDING,
    QK_NORM_TENSORS,
    Family,
)


def _refuse(field, value, why):
    return ValueError(f"config.json: {field}={value!r} is not supported: {why}")


def read_moe(config: dict) -> dict:
    experts = config.get("num_experts", config.get("num_local_experts", 128))
    if config.get("decoder_sparse_step", 1) != 1:
        raise _refuse("decoder_sparse_step", config["decoder_sparse_step"],
                      "every layer must be a mixture of experts")
    if config.get("mlp_only_layers"):
        raise _refuse("mlp_only_layers", config["mlp_only_layers"], "dense layers inside a MoE "
                      "model are not implemented")
    return dict(qk_norm=True, num_experts=experts, num_experts_per_tok=config.get("num_experts_per_tok", 8),
                moe_intermediate_size=config.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)))


_NO_MLP = {k: v for k, v in LLAMA_TENSORS.items() if not k.startswith("mlp.")}
FAMILIES = {
    "qwen3": Family("qwen3", ("Qwen3ForCausalLM",), max_position_embeddings=32768, rms_norm_eps=1e-6,
                    read=lambda config: dict(qk_norm=True), tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS},
                    sharding={**DENSE_SHARDING, **QK_NORM_SHARDING}),
    "qwen3_moe": Family(
        "qwen3_moe", ("Qwen3MoeForCausalLM",), max_position_embeddings=32768, rms_norm_eps=1e-6,
        fields=frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                          "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                          "mlp_only_layers"}),
        read=read_moe, tensors={**_NO_MLP, **QK_NORM_TENSORS},
        experts=("mlp.experts.{j}.", {"gate_proj.weight": "gate", "up_proj.weight": "up",
                                       "down_proj.weight": "down"}, "mlp.gate.weight"),
        sharding={**DENSE_SHARDING, **QK_NORM_SHARDING, **MOE_SHARDING}),
}
