"""What a family module declares: its transformers names, defaults, extra config fields and tensors.

models/hf_config.py reads the fields every family shares (shapes, RoPE, window, head) and hands
a family's own fields to its `read`; models/hf_loader.py maps a layer's tensors by `tensors`
(Hugging Face suffix -> our name) and, for a mixture of experts, stacks the per-expert tensors
named by `expert_tensors`; models/sharding.py splits each parameter by the family's `sharding`
table (our parameter name -> its split: "rows"/"cols" of the model axis, "experts" over the
expert axis, or None for replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# The tensors of a Llama-style layer (Hugging Face suffix -> our name, models/weights.py).
LLAMA_TENSORS = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}
QK_NORM_TENSORS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}

# Served parameter name -> how it is split (models/sharding.py applies it).
DENSE_SHARDING = {
    "embed": "vocab", "output_proj": "vocab", "final_norm": None, "attn_norm": None,
    "mlp_norm": None, "qkv_proj": "heads", "bqkv": "heads", "o_proj": "heads_in",
    "gate_up_proj": "mlp", "down_proj": "mlp_in",
}
QK_NORM_SHARDING = {"q_norm": None, "k_norm": None}
MOE_SHARDING = {"router": None, "experts_gate_up": "experts_mlp", "experts_down": "experts_mlp_in"}


def _no_fields(config: dict) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]  # the transformers classes whose causal LM head we serve
    # What transformers' config class gives a field config.json omits (max_position_embeddings,
    # rms_norm_eps, sliding_window), and whether q/k/v always carry a bias.
    max_position_embeddings: int
    rms_norm_eps: float
    sliding_window: int | None = None
    qkv_bias: bool = False
    mixed_layers: bool = False  # may mix sliding and global layers (each kind its own RoPE)
    fields: frozenset = frozenset()  # config.json fields only this family reads
    read: Callable[[dict], dict] = _no_fields  # those fields -> ModelConfig keyword arguments
    tensors: dict = dataclasses.field(default_factory=lambda: dict(LLAMA_TENSORS))
    # A mixture of experts: (HF prefix of expert j with "{j}", {HF suffix: "gate" | "up" | "down"},
    # the router's HF suffix).
    experts: tuple | None = None
    sharding: dict = dataclasses.field(default_factory=lambda: dict(DENSE_SHARDING))
    activations: tuple[str, ...] = ("silu", "swish")  # hidden_act values meaning its MLP's act
