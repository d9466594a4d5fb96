"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata or a HF config.json.

Llama 2/3, Mistral, Qwen2 and SmolLM2 share one architecture: RMSNorm, RoPE (plain, linear or
llama3 scaling), grouped-query attention, a SwiGLU MLP, tied or untied embeddings and, for Qwen2,
a bias on the q/k/v projections. Anything else is rejected by name: the readers of the two
checkpoint formats' configs, strict about every field that changes the computation, are
models/hf_config.py (config.json, transformers 4 and 5) and models/gguf_config.py (GGUF metadata).
"""

from __future__ import annotations

import dataclasses

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_SCALING_TYPES)})"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: int | None = None  # Mistral's attention window, if any

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * e * f + 2 * e
        embed = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + e

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """Bytes of K and V of one token over all layers, at `itemsize` bytes per value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


# Named shapes for random weights (performance work and tests without downloads).
PRESETS: dict[str, dict] = {
    "tiny": dict(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-qwen2": dict(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                       max_position_embeddings=1024, attention_bias=True),
    # The default model's head counts (9 q / 3 KV heads) at tiny size, untied, with MLP and
    # vocabulary sizes no tensor-parallel size divides: the padding cases of models/sharding.py.
    "tiny-gqa3": dict(architecture="llama", vocab_size=254, hidden_size=64, intermediate_size=90,
                      num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=False),
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "llama3.1-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    "llama3-70b": dict(architecture="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False),
    # Mistral-7B-v0.1's shape, with its 4,096-token sliding window.
    "mistral-7b": dict(architecture="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=32768, rope_theta=10000.0,
                       sliding_window=4096),
    "qwen2-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                     head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                     attention_bias=True),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ModelConfig(name=f"random:{name}", **PRESETS[name])
