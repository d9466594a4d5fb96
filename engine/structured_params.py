"""StructuredOutputsParams: the constraint one request asks for (vLLM's `structured_outputs` names).

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
object), `regex`, `choice` (one of these strings) or `grammar` (Lark, or GBNF as llama.cpp writes
it) is set. `param` names the request field it came from (the server sets "response_format" or
"tools" for what it builds from those), so a grammar that does not compile is a 400 naming it.
JSON output is compact by default: `", "` and `": "` between items and keys and no other
whitespace, so a small model at temperature 1 cannot wander off into endless blank space;
`disable_any_whitespace` drops the two spaces too. Only the stdlib (and ParamError) here: the HTTP
layer imports it. It sits at the top of engine/, below SamplingParams, which carries one; the
grammar work is in engine/structured_output/.
"""

from __future__ import annotations

import dataclasses
import json as _json

from engine.errors import ParamError

MAX_GRAMMAR_CHARS = 200_000  # a schema / regex / grammar text longer than this is refused
MAX_CHOICES = 1024


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    param: str = dataclasses.field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ParamError(self.param, f"'{self.param}' must set exactly one of json, json_object, regex, "
                               f"choice, grammar; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, dict):
                text = _json.dumps(self.json, sort_keys=True)
            elif isinstance(self.json, str):
                text = self.json
            else:
                raise ParamError(self._field("json"), f"'{self._field('json')}' must be a JSON schema (an object)")
            self._check_size("json", text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ParamError(self._field(name), f"'{self._field(name)}' must be a non-empty string")
                self._check_size(name, value)
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, list | tuple) or not choice:
                raise ParamError(self._field("choice"), f"'{self._field('choice')}' must be a non-empty array of strings")
            if len(choice) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choice):
                raise ParamError(self._field("choice"), f"'{self._field('choice')}' must hold 1 to {MAX_CHOICES} "
                                   "non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
            self._check_size("choice", "".join(choice))
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(self._field(name), f"'{self._field(name)}' must be a boolean")

    def _field(self, name: str) -> str:
        return self.param if self.param != "structured_outputs" else f"structured_outputs.{name}"

    def _check_size(self, name: str, text: str) -> None:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ParamError(self._field(name), f"'{self._field(name)}' is longer than {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def error_param(self) -> str:
        """The field a compile error names."""
        return self._field(self.kind)

    def key(self) -> tuple:
        """What identifies the compiled grammar (the LRU key)."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if isinstance(value, dict):
            value = _json.dumps(value, sort_keys=True)
        return (self.kind, value, self.disable_any_whitespace)

    @classmethod
    def from_dict(cls, value, *, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From vLLM's request field: {"json" | "regex" | "choice" | "grammar" | "json_object", ...}."""
        if not isinstance(value, dict):
            raise ParamError(param, f"'{param}' must be an object")
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParamError(f"{param}.{unknown[0]}", f"'{param}.{unknown[0]}' is not a supported "
                               f"structured output field ({', '.join(sorted(known))})")
        values = {k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)}
        values.setdefault("disable_any_whitespace", False)
        return cls(**values, param=param)
