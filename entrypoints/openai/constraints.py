"""Request fields that constrain what may be sampled: OpenAI's `response_format` and `logit_bias`,
vLLM's `structured_outputs`, `allowed_token_ids` and `bad_words`.

`parse_constraints(body)` returns SamplingParams keyword values. Shapes are checked here (a 400
naming the field); whether a schema, regex or grammar compiles is checked when the request is
prepared (prepare.py, through the engine's GrammarCompiler, on a worker thread).
- response_format: {"type": "text"} (nothing), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (strict or not, the schema is enforced).
- structured_outputs: {"json" | "json_object" | "regex" | "choice" | "grammar", "disable_any_whitespace"};
  with response_format too it is a 400 (two constraints).
- logit_bias: {"<token id>": bias}, keys decimal token-id strings (JSON object keys), values in
  [-100, 100] (OpenAI's range).
"""

from __future__ import annotations

from engine.errors import ParamError
from engine.sampling_params import kind_of
from engine.structured_params import StructuredOutputsParams
from entrypoints.openai.errors import ProtocolError


def _error(param: str, message: str) -> ProtocolError:
    return ProtocolError(message, param=param)


def _response_format(value) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise _error("response_format", f"'response_format' must be an object, got {kind_of(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _error("response_format.json_schema", "'response_format.json_schema' must be an object with "
                         "'name' and 'schema'")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise _error("response_format.json_schema.name", "'response_format.json_schema.name' must be a string")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _error("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _error("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON "
                         f"schema (an object), got {kind_of(schema)}")
        return StructuredOutputsParams(json=schema, param="response_format.json_schema.schema")
    shown = repr(kind[:40]) if isinstance(kind, str) else kind_of(kind)
    raise _error("response_format.type", "'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                 f"got {shown}")


def _logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _error("logit_bias", f"'logit_bias' must be an object mapping token ids to biases, got {kind_of(value)}")
    out = {}
    for key, bias in value.items():
        text = key.strip() if isinstance(key, str) else ""
        if not (text.isdigit() and text.isascii() and len(text) <= 10):
            raise _error("logit_bias", f"'logit_bias' keys must be token ids (decimal integers), got {str(key)[:40]!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise _error("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {kind_of(bias)}")
        if not -100 <= bias <= 100:
            raise _error("logit_bias", f"'logit_bias' values must be in [-100, 100], got {bias!r} for token {text}")
        out[int(text)] = float(bias)
    return out or None


def parse_constraints(body: dict) -> dict:
    """SamplingParams keyword values for the constraint fields present in `body`."""
    values: dict = {}
    try:
        formats = []
        if body.get("response_format") is not None:
            fmt = _response_format(body["response_format"])
            if fmt is not None:
                formats.append(fmt)
        if body.get("structured_outputs") is not None:
            formats.append(StructuredOutputsParams.from_dict(body["structured_outputs"]))
        if len(formats) > 1:
            raise _error("structured_outputs", "'structured_outputs' and 'response_format' both constrain the output; "
                         "send one of them")
        if formats:
            values["structured_outputs"] = formats[0]
    except ParamError as exc:
        raise _error(exc.param, str(exc)) from None
    bias = _logit_bias(body.get("logit_bias"))
    if bias is not None:
        values["logit_bias"] = bias
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed):
            raise _error("allowed_token_ids", "'allowed_token_ids' must be a non-empty array of token ids")
        values["allowed_token_ids"] = tuple(allowed)
    bad_words = body.get("bad_words")
    if bad_words is not None:
        if not isinstance(bad_words, list) or not all(isinstance(w, str) and w for w in bad_words):
            raise _error("bad_words", "'bad_words' must be an array of non-empty strings")
        if bad_words:
            values["bad_words"] = tuple(bad_words)
    return values
