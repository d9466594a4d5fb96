"""SpeculativeConfig: the speculative-decoding knobs, vLLM's names where they exist, validated once.

Pure Python (no jax): the server's flag parser and EngineConfig build it. `EngineConfig(
speculative_config={...})` takes a dict (or a SpeculativeConfig); an unknown key or a bad value is a
ValueError naming `speculative_config.<key>`.
"""

from __future__ import annotations

import dataclasses

METHODS = ("ngram", "draft_model", "draft_head")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # ngram (prompt lookup) | draft_model | draft_head (EAGLE-style head)
    num_speculative_tokens: int = 3  # k: drafts per row; one value per engine (1 + k logit rows)
    # ngram: the longest suffix of the request's tokens of prompt_lookup_min..max tokens that
    # occurred before proposes the tokens that followed it.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # draft_model: any model spec the loaders take (shares the tokenizer); draft_head: the folder
    # of a head trained for the target (python -m experiments.train_draft)
    model: str | None = None
    # The load switch, per step: speculation is off while more than this many decode rows run
    # (None: never by batch size) ... 2 from the CPU sweep (experiments.ideas.speculative): always-on
    # drafting lost to off from 4 rows on (rewrite/ngram 0.95x, ShareGPT 0.8x) and gained at 1-2.
    disable_by_batch_size: int | None = 2
    # ... or while decode rows with their drafts would take more than this share of the token
    # budget; it comes back on below `enable_hysteresis` times either threshold, so it does not flap.
    disable_by_token_share: float = 0.5
    enable_hysteresis: float = 0.75
    # The acceptance switch, per request: an EMA (weight acceptance_ema_alpha) of accepted/drafted
    # below min_acceptance_rate stops drafting for it; it is re-probed every probe_interval steps.
    # 0.35 is the break-even measured on the 2-core CPU in float32, where each draft token costs
    # about a third of a one-token step (experiments.ideas.speculative, BUILD_NOTES "Speculative
    # decoding"); an accelerator, whose decode step is weight-read-bound, breaks even far lower (set
    # ~0.1 there).
    min_acceptance_rate: float = 0.35
    acceptance_ema_alpha: float = 0.3
    probe_interval: int = 16
    # draft_head: a row's chain stops before the first draft whose confidence (the product of the
    # head's top-1 probabilities up to it) is below this, so unlikely drafts cost no verification;
    # 0 always drafts k. The default is from the held-out sweep in BUILD_NOTES.md.
    draft_confidence_threshold: float = 0.25

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) must be "
                             f">= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs a draft model spec "
                             "(a GGUF file, a HF folder, an orbax folder or random:<name>)")
        if self.method == "draft_head" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_head' needs the folder of a draft "
                             "head trained for the target (python -m experiments.train_draft)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model must be a non-empty string, got {self.model!r}")
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 1)
        _fraction("disable_by_token_share", self.disable_by_token_share)
        _fraction("enable_hysteresis", self.enable_hysteresis)
        _fraction("min_acceptance_rate", self.min_acceptance_rate, allow_zero=True)
        _fraction("acceptance_ema_alpha", self.acceptance_ema_alpha)
        _int("probe_interval", self.probe_interval, 1)
        _fraction("draft_confidence_threshold", self.draft_confidence_threshold, allow_zero=True)

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """A dict (vLLM style), a SpeculativeConfig, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}")


def _fraction(name: str, value, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (
        (0 <= value <= 1) if allow_zero else (0 < value <= 1))
    if not ok:
        bounds = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"speculative_config.{name} must be a number in {bounds}, got {value!r}")
