"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata or a HF config.json.

Llama 2/3, Mistral, Qwen2 and SmolLM2 share one architecture: RMSNorm, RoPE (plain, linear or
llama3 scaling), grouped-query attention, a SwiGLU MLP, tied or untied embeddings and, for Qwen2,
a bias on the q/k/v projections. Anything else is rejected by name.
"""

from __future__ import annotations

import dataclasses
import json
import os

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

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "hf") -> ModelConfig:
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            name=name,
            architecture=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling_from_hf(config.get("rope_scaling")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            sliding_window=config.get("sliding_window") if config.get("use_sliding_window", model_type == "mistral") else None,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike) -> ModelConfig:
        path = os.path.join(folder, "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json in the model folder") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: config.json is not valid JSON ({e})") from None
        try:
            return cls.from_hf_config(config, name=os.path.basename(os.path.normpath(folder)))
        except KeyError as e:
            raise ValueError(f"{path}: config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: dict, name: str, tensor_names: set[str]) -> ModelConfig:
        """`meta` maps GGUF keys (e.g. "llama.block_count") to Python values."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def get(key, default=None, required=True):
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if required and default is None:
                raise ValueError(f"GGUF metadata lacks {full!r}")
            return default

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(get("rope.dimension_count", hidden // num_heads, required=False))
        head_dim = int(get("attention.key_length", head_dim, required=False))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        scaling_type = get("rope.scaling.type", "", required=False)
        if scaling_type == "linear":
            scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
        elif scaling_type not in ("", "none"):
            raise ValueError(f"unsupported rope scaling {scaling_type!r} in GGUF metadata")
        if arch == "llama" and "rope_freqs.weight" in tensor_names:
            # llama3 scaling is baked into a rope_freqs tensor; its parameters are the Llama 3.1 ones.
            scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
        return cls(
            name=name,
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads, required=False)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 2048, required=False)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            sliding_window=None,
        )


def _rope_scaling_from_hf(scaling: dict | None) -> RopeScaling | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3)")


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
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ModelConfig(name=f"random:{name}", **PRESETS[name])
