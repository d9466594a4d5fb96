"""SamplingParams: what a caller asks of one request's generation (vLLM's names and defaults).

Validated on construction against `BOUNDS`, the one table of what each numeric field may hold: the
ranges the device arrays take (int32 lengths and ids, float32 knobs) and the limits that keep one
request from hurting the others. The HTTP layer (entrypoints/openai/protocol.py) checks the same
table through `check_bound`, so a value is refused in one place with one message. Every error is a
`ParamError` (engine/errors.py): a ValueError that carries the field (`param`), so the server's 400
names it without reading the message.
"""

from __future__ import annotations

import dataclasses
import math

from engine.errors import ParamError
from engine.structured_params import StructuredOutputsParams

INT32_MAX = 2**31 - 1

# Bounds that keep one request from hurting the others (a huge stop list is scanned at every step).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_BAD_WORDS = 128
MAX_ALLOWED_TOKEN_IDS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values one numeric field may take: `low` (excluded if `low_open`) to `high`."""

    kind: type  # int or float
    low: int | float
    high: int | float
    low_open: bool = False


# Field -> bound. Integer fields end up in int32 device arrays (or are hashed: seed), float fields
# in float32 ones; list fields (stop_token_ids, prompt_token_ids) bound each entry.
BOUNDS: dict[str, Bound] = {
    "n": Bound(int, 1, MAX_N),
    "max_tokens": Bound(int, 1, INT32_MAX),  # the prompt + max_tokens <= max_model_len check follows
    "temperature": Bound(float, 0.0, 100.0),
    "top_p": Bound(float, 0.0, 1.0, low_open=True),
    "top_k": Bound(int, -1, INT32_MAX),  # -1/0 = off; the engine clamps it to the vocabulary
    "min_p": Bound(float, 0.0, 1.0),
    "presence_penalty": Bound(float, -2.0, 2.0),
    "frequency_penalty": Bound(float, -2.0, 2.0),
    "repetition_penalty": Bound(float, 0.0, 100.0, low_open=True),
    "seed": Bound(int, -(2**63), 2**64 - 1),  # any 64-bit seed; hashed to uint32 per sample
    "logprobs": Bound(int, 0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(int, 0, MAX_LOGPROBS),
    "stop_token_ids": Bound(int, 0, INT32_MAX),  # each entry
    "prompt_token_ids": Bound(int, 0, INT32_MAX),  # each entry; the engine checks the vocabulary
    "logit_bias": Bound(float, -100.0, 100.0),  # each value (OpenAI's range); keys are token ids
    "allowed_token_ids": Bound(int, 0, INT32_MAX),  # each entry; the engine checks the vocabulary
}


def kind_of(value) -> str:
    """The JSON name of a value's type, for error messages."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {dict: "object", list: "array", tuple: "array", str: "string", type(None): "null"}.get(
        type(value), type(value).__name__)


def _show(value) -> str:
    if isinstance(value, int) and abs(value) > 10**30:  # str() of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def check_bound(name: str, value, *, param: str | None = None) -> int | float:
    """`value` checked against BOUNDS[name]; returns it (a float field as a float). ParamError
    naming `param` (default: `name`) otherwise."""
    bound = BOUNDS[name]
    param = param or name
    if bound.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(param, f"'{param}' must be an integer, got {kind_of(value)}")
    else:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ParamError(param, f"'{param}' must be a number, got {kind_of(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ParamError(param, f"'{param}' must be a finite number, got {value}")
    if (value <= bound.low) if bound.low_open else (value < bound.low):
        op = ">" if bound.low_open else ">="
        raise ParamError(param, f"'{param}' must be {op} {bound.low}, got {_show(value)}")
    if value > bound.high:
        raise ParamError(param, f"'{param}' must be <= {bound.high}, got {_show(value)}")
    return float(value) if bound.kind is float else value


def check_stop_strings(stop, *, param: str = "stop") -> tuple[str, ...]:
    """Stop strings: at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_STRING_LEN."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ParamError(param, f"'{param}' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ParamError(param, f"'{param}' entries must be non-empty strings, got {kind_of(s)}")
        if len(s) > MAX_STOP_STRING_LEN:
            raise ParamError(param, f"'{param}' entries must be at most {MAX_STOP_STRING_LEN} characters")
    return tuple(stop)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # independent completions for the prompt
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max
    presence_penalty: float = 0.0  # OpenAI: subtract once if the token appeared in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output
    seed: int | None = None  # per-request seed; same seed, same tokens, whatever the batch
    stop: tuple[str, ...] = ()  # stop strings; not part of the returned text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per generated token (+ the sampled one)
    # top-n log-probabilities per prompt token (+ the token's own), vLLM's prompt_logprobs:
    # RequestOutput.prompt_logprobs, None for the first token. The prompt skips the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (engine/structured_output/): a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> bias in [-100, 100], added to the logits; stored as sorted
    # (id, bias) pairs (a dict is accepted).
    logit_bias: tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be sampled
    bad_words: tuple[str, ...] | None = None  # words never generated (vLLM's semantics)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", check_stop_strings(tuple(stop)))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            check_bound(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):  # optional
            if getattr(self, name) is not None:
                check_bound(name, getattr(self, name))
        for t in self.stop_token_ids:
            check_bound("stop_token_ids", t)
        self._check_logit_controls()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(name, f"'{name}' must be a boolean, got {kind_of(getattr(self, name))}")

    def _check_logit_controls(self) -> None:
        so = self.structured_outputs
        if isinstance(so, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ParamError("structured_outputs", "'structured_outputs' must be a StructuredOutputsParams or a dict")
        bias = self.logit_bias
        if bias is not None:
            items = bias.items() if isinstance(bias, dict) else bias
            try:
                pairs = sorted((k, v) for k, v in items)
            except (TypeError, ValueError):
                raise ParamError("logit_bias", "'logit_bias' must map token ids to numbers") from None
            if len(pairs) > MAX_LOGIT_BIAS:
                raise ParamError("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries")
            for k, v in pairs:
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= INT32_MAX:
                    raise ParamError("logit_bias", f"'logit_bias' keys must be token ids (integers >= 0), got {_show(k)}")
                check_bound("logit_bias", v)
            object.__setattr__(self, "logit_bias", tuple((k, float(v)) for k, v in pairs) or None)
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ParamError("allowed_token_ids", "'allowed_token_ids' must hold at least one token id")
            for t in ids:
                check_bound("allowed_token_ids", t)
            object.__setattr__(self, "allowed_token_ids", ids)
        if self.bad_words is not None:
            words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
            if len(words) > MAX_BAD_WORDS or not all(isinstance(w, str) and w for w in words):
                raise ParamError("bad_words", f"'bad_words' must hold at most {MAX_BAD_WORDS} non-empty strings")
            object.__setattr__(self, "bad_words", words or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Builds from keyword values, rejecting unknown fields by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ParamError(unknown[0], f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**values)
