"""ModelConfig: the shape of a decoder, read from GGUF metadata or a HF config.json.

Every family served is one pre-norm decoder (models/llama.py) whose variations are fields here:
Llama 2/3, Mistral, Qwen2 and SmolLM2 (RMSNorm, RoPE plain / linear / llama3, grouped-query
attention, SwiGLU, tied or untied head, Qwen2's q/k/v bias); Qwen3 (per-head RMSNorm on q and k
before RoPE: `qk_norm`); Gemma 2 and 3 (`norm_offset` 1: RMSNorm scales by 1 + w; `embed_scale`:
embeddings times sqrt(hidden); GeGLU, `hidden_act="gelu_tanh"`; `sandwich_norms`: a norm after
attention and after the MLP too; `query_pre_attn_scalar`; soft-capped attention and final logits;
per-layer `layer_types` mixing sliding-window and global layers, each kind with its own RoPE);
mixtures of experts (Mixtral, Qwen3-MoE: `num_experts` routed experts, top `num_experts_per_tok`,
`norm_topk_prob`). Anything else is rejected by name: the readers of the two checkpoint formats'
configs, strict about every field that changes the computation, are models/hf_config.py with
models/families/ (config.json, transformers 4 and 5) and models/gguf_config.py (GGUF metadata).
"""

from __future__ import annotations

import dataclasses

from models import kv_bytes

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral",
                           "qwen3_moe")
ROPE_SCALING_TYPES = ("linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU (tanh-approximated GELU)


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
    sliding_window: int | None = None  # the window of the sliding layers (every layer if no layer_types)
    # Per layer, "full_attention" or "sliding_attention" (None: every layer slides when
    # sliding_window is set, else every layer is global).
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    local_rope_scaling: RopeScaling | None = None  # their scaling (used only with local_rope_theta)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + weight): 1 for Gemma
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"  # one of HIDDEN_ACTS: the gated MLP's activation
    sandwich_norms: bool = False  # norms after attention and after the MLP as well (Gemma)
    query_pre_attn_scalar: float | None = None  # softmax scale is its rsqrt (None: head_dim's)
    attn_logit_softcap: float | None = None  # cap * tanh(logit / cap) on attention logits
    final_logit_softcap: float | None = None  # the same on the output logits
    num_experts: int = 0  # routed experts per layer (0: a dense MLP)
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: int | None = None  # each expert's MLP width (None: intermediate_size)
    norm_topk_prob: bool = True  # renormalize the chosen experts' probabilities (Mixtral: always)

    def __post_init__(self) -> None:
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # from JSON lists
        for field in ("rope_scaling", "local_rope_scaling"):
            if isinstance(getattr(self, field), dict):
                object.__setattr__(self, field, RopeScaling(**getattr(self, field)))
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
        self._check_variants()

    def _check_variants(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(k not in LAYER_TYPES for k in self.layer_types):
                raise ValueError(f"ModelConfig.layer_types must list {self.num_layers} entries among "
                                 f"{', '.join(LAYER_TYPES)}, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is None")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or
                                                not isinstance(self.sliding_window, int) or
                                                self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive integer or None, "
                             f"got {self.sliding_window!r}")
        for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{field} must be > 0 or None, got {value!r}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                                 f"{self.num_experts}], got {self.num_experts_per_tok!r}")
        elif self.num_experts_per_tok or self.moe_intermediate_size:
            raise ValueError("ModelConfig.num_experts_per_tok / moe_intermediate_size need num_experts > 0")

    # ---- per-layer attention kinds --------------------------------------------------------

    def layer_kind(self, index: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[index]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    @property
    def has_sliding_layers(self) -> bool:
        """Some layer attends over a sliding window (Mistral v0.1: every layer; Gemma 2/3: some)."""
        return "sliding_attention" in self.layer_kinds

    @property
    def mixes_windows(self) -> bool:
        """Both sliding-window and global layers (Gemma 2/3): the KV cache can keep a block group
        per kind (engine/step/kv_cache.py, scheduler/sliding_window.py)."""
        return len(set(self.layer_kinds)) == 2

    def num_layers_of_kind(self, kind: str) -> int:
        return self.layer_kinds.count(kind)

    def window_of(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding_attention" else None

    def rope_of(self, kind: str) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of a layer kind's RoPE."""
        if kind == "sliding_attention" and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def layer_period(self) -> int:
        """The shortest p with layer_kind(i) == layer_kind(i % p) for every layer: the layer scan
        runs groups of p layers, each position with its own static window and RoPE."""
        kinds = self.layer_kinds
        for p in range(1, self.num_layers + 1):
            if all(kinds[i] == kinds[i % p] for i in range(self.num_layers)):
                return p
        return self.num_layers

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_params(self) -> int:
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * e * f if not self.num_experts else self.num_experts * (3 * e * self.expert_size + e)
        layer = attn + mlp + 2 * e * (2 if self.sandwich_norms else 1) + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + e

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """Bytes of K and V of one token over all layers, at `itemsize` bytes per value
        (models/kv_bytes.py's rule, the model dtype's cache)."""
        return kv_bytes.kv_bytes_per_token(self, itemsize)


def _alternating(num_layers: int, period: int) -> tuple[str, ...]:
    """Gemma's interleaving: every `period`-th layer global, the others sliding."""
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(num_layers))


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
_GEMMA = dict(rms_norm_eps=1e-6, norm_offset=1.0, embed_scale=True, hidden_act="gelu_tanh",
              sandwich_norms=True, tie_word_embeddings=True)
_GEMMA2 = dict(_GEMMA, architecture="gemma2", rope_theta=10000.0, attn_logit_softcap=50.0,
               final_logit_softcap=30.0)
# Gemma 3: five local layers (window 1024, RoPE base 10 000) to one global (base 1e6, linear x8).
_GEMMA3 = dict(_GEMMA, architecture="gemma3_text", qk_norm=True, max_position_embeddings=131072,
               sliding_window=1024, rope_theta=1000000.0, rope_scaling=RopeScaling("linear", 8.0),
               local_rope_theta=10000.0)

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
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     qk_norm=True),
    "gemma2-9b": dict(_GEMMA2, vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                      num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                      max_position_embeddings=8192, query_pre_attn_scalar=256.0, sliding_window=4096,
                      layer_types=_alternating(42, 2)),
    "gemma3-12b": dict(_GEMMA3, vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                       num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
                       query_pre_attn_scalar=256.0, layer_types=_alternating(48, 6)),
    "gemma3-27b": dict(_GEMMA3, vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                       num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                       query_pre_attn_scalar=168.0, layer_types=_alternating(62, 6)),
    "mixtral-8x7b": dict(architecture="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                         num_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_layers=48,
                          num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True),
    # Tiny members of each new family, for tests.
    "tiny-qwen3": dict(_TINY, architecture="qwen3", qk_norm=True),
    "tiny-gemma2": dict(_TINY, **_GEMMA2, query_pre_attn_scalar=24.0, sliding_window=8,
                        layer_types=_alternating(2, 2)),
    "tiny-gemma3": dict(_TINY, **{**_GEMMA3, "sliding_window": 8}, num_layers=4,
                        query_pre_attn_scalar=16.0, layer_types=_alternating(4, 3)),
    "tiny-mixtral": dict(_TINY, architecture="mixtral", tie_word_embeddings=False, num_experts=4,
                         num_experts_per_tok=2),
    "tiny-qwen3-moe": dict(_TINY, architecture="qwen3_moe", qk_norm=True, num_experts=8,
                           num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False),
    # A small MoE for CPU benchmarks: 8 experts, top-2 (bench_offline).
    "small-moe": dict(architecture="mixtral", vocab_size=4096, hidden_size=256, intermediate_size=512,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                      max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ModelConfig(name=f"random:{name}", **PRESETS[name])
