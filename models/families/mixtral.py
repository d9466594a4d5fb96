"""Mixtral: Mistral's attention with a mixture of experts in every layer (top-2 of 8, the softmax
over the chosen router logits: softmax, top-k, renormalized)."""

from models.families.base import DENSE_SHARDING, LLAMA_TENSORS, MOE_SHARDING, Family


def read_mixtral(config: dict) -> dict:
    return dict(num_experts=config.get("num_local_experts", 8),
                num_experts_per_tok=config.get("num_experts_per_tok", 2), norm_topk_prob=True)


FAMILIES = {
    "mixtral": Family(
        "mixtral", ("MixtralForCausalLM",), max_position_embeddings=131072, rms_norm_eps=1e-5,
        fields=frozenset({"num_local_experts", "num_experts_per_tok"}), read=read_mixtral,
        tensors={k: v for k, v in LLAMA_TENSORS.items() if not k.startswith("mlp.")},
        experts=("block_sparse_moe.experts.{j}.", {"w1.weight": "gate", "w3.weight": "up",
                                                    "w2.weight": "down"}, "block_sparse_moe.gate.weight"),
        sharding={**DENSE_SHARDING, **MOE_SHARDING}),
}
