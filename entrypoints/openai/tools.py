"""Tool calls on chat completions: `tools`, `tool_choice`, the prompt, and parsing the answer.

1. `parse_tools(body)` validates `tools` (functions with a name and a JSON-schema `parameters`)
   and `tool_choice` ("none", "auto", "required", or {"type": "function", "function": {"name"}})
   into a `ToolPlan`; a malformed tool or a named choice that is not in `tools` is a 400 naming
   the field. A schema that does not compile is refused when the request is prepared.
2. Forced calls are grammar-enforced (`forced_grammar`): a named function's output is its
   arguments object, validated by its `parameters` schema; "required" is one object
   {"name": <one of the tools>, "arguments": <that tool's parameters>} (one call per response).
3. "auto": the tools go to the chat template as `tools` when it uses them; otherwise (e.g.
   SmolLM2's template) a system message lists them in the Hermes format. The answer is parsed for
   Hermes / Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks, or a Llama-3.1 JSON call
   ({"name", "parameters"}, optionally after <|python_tag|>, several separated by ";").
   "none": the tools are not shown and the answer is plain content.
4. `ToolStreamer` turns text deltas into OpenAI's `delta.tool_calls` chunks: a named call streams
   its arguments as they are generated; required and auto calls are sent whole once parsed (auto
   streams ordinary content until something may be a tool call).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from engine.sampling_params import kind_of
from engine.structured_params import StructuredOutputsParams
from entrypoints.openai.errors import ProtocolError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _error(param: str, message: str) -> ProtocolError:
    return ProtocolError(message, param=param)


@dataclasses.dataclass
class ToolPlan:
    tools: list[dict]  # [{"name", "description", "parameters"}]
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def tool(self, name: str) -> dict | None:
        return next((t for t in self.tools if t["name"] == name), None)


def parse_tools(body: dict) -> ToolPlan | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _error("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _error("tools", f"'tools' must be an array of at most {MAX_TOOLS} tools")
    parsed = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _error(where, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _error(f"{where}.function.name", f"'{where}.function.name' must be 1-64 letters, digits, _ . -")
        if any(t["name"] == name for t in parsed):
            raise _error(f"{where}.function.name", f"'{where}.function.name': {name!r} appears twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _error(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON schema "
                         f"(an object), got {kind_of(params)}")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _error(f"{where}.function.description", f"'{where}.function.description' must be a string")
        parsed.append({"name": name, "description": description or "", "parameters": params, "param": where})
    if choice is None:
        choice = "auto" if parsed else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _error("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if not any(t["name"] == name for t in parsed):
            raise _error("tool_choice", f"'tool_choice' names the function {name[:64]!r}, which is not in 'tools'")
        return ToolPlan(parsed, "named", name)
    if choice not in ("none", "auto", "required"):
        raise _error("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a named function")
    if choice == "required" and not parsed:
        raise _error("tool_choice", "'tool_choice' is 'required' but 'tools' is empty")
    return ToolPlan(parsed, choice)


def forced_grammar(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The JSON-schema grammar of a forced call (named or required); None otherwise."""
    if plan.choice == "named":
        tool = plan.tool(plan.name)
        return StructuredOutputsParams(json=tool["parameters"], param=f"{tool['param']}.function.parameters")
    if plan.choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in plan.tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return StructuredOutputsParams(json=schema, param="tools")
    return None


def tool_check_grammars(plan: ToolPlan) -> list[StructuredOutputsParams]:
    """One grammar per tool's parameters, to refuse a schema that does not compile, naming it."""
    return [StructuredOutputsParams(json=t["parameters"], param=f"{t['param']}.function.parameters")
            for t in plan.tools]


def template_tools(plan: ToolPlan) -> list[dict]:
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
            for t in plan.tools]


def hermes_system_prompt(plan: ToolPlan) -> str:
    """A compact Hermes-style tools prompt (a named choice shows only its function)."""
    tools = [plan.tool(plan.name)] if plan.choice == "named" else plan.tools
    listing = "\n".join(json.dumps({k: t[k] for k in ("name", "description", "parameters") if t[k]},
                                   ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (f"You can call functions. Tools:\n<tools>\n{listing}\n</tools>\nTo call one, answer "
            '<tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call>')


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of(obj, plan: ToolPlan) -> dict | None:
    if not isinstance(obj, dict) or plan.tool(obj.get("name")) is None:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return new_call(obj["name"], args)
    return new_call(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a finished answer; tool_calls None when there is none."""
    if plan.choice == "none":
        return text, None
    if plan.choice == "named":
        return None, [new_call(plan.name, text.strip())]
    if plan.choice == "required":
        try:
            call = _call_of(json.loads(text), plan)
        except ValueError:
            call = None
        return (None, [call]) if call else (text, None)
    start = text.find(HERMES_OPEN)
    if start >= 0:
        calls = []
        for body in _HERMES.findall(text[start:]):
            try:
                call = _call_of(json.loads(body), plan)
            except ValueError:
                call = None
            if call:
                calls.append(call)
        if calls:
            content = text[:start]
            return (content if content.strip() else None), calls
        return text, None
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = []
        for part in stripped.split(";"):
            try:
                call = _call_of(json.loads(part), plan)
            except ValueError:
                return text, None
            if call is None:
                return text, None
            calls.append(call)
        return None, calls
    return text, None


class ToolStreamer:
    """Per streamed choice: text deltas in, delta bodies out (see the module walkthrough)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.num_sent = 0  # content characters already sent (auto)
        self.call_id: str | None = None  # named: the call's id once its first chunk went out
        self.has_calls = False

    def _held(self) -> int:
        """auto: where the content that may still become a tool call starts."""
        stripped = self.text.lstrip()
        for marker in (PYTHON_TAG, "{"):
            if stripped.startswith(marker) or (stripped and marker.startswith(stripped)):
                return 0
        at = self.text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for n in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
            if self.text.endswith(HERMES_OPEN[:n]):
                return len(self.text) - n
        return len(self.text)

    def feed(self, delta_text: str, finishing: bool) -> dict:
        """The delta body for this chunk ({} when nothing is to be sent yet)."""
        self.text += delta_text
        plan = self.plan
        if plan.choice == "none":
            return {"content": delta_text} if delta_text else {}
        if plan.choice == "named":
            if self.call_id is None:
                call = new_call(plan.name, delta_text)
                self.call_id, self.has_calls = call["id"], True
                return {"tool_calls": [{"index": 0, **call}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]} if delta_text else {}
        body: dict = {}
        if not finishing:
            if plan.choice == "auto":
                held = self._held()
                if held > self.num_sent:
                    body["content"] = self.text[self.num_sent:held]
                    self.num_sent = held
            return body
        content, calls = parse_tool_output(plan, self.text)
        if calls:
            self.has_calls = True
            rest = (content or "")[self.num_sent:]
            if rest:
                body["content"] = rest
            body["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        elif len(self.text) > self.num_sent:
            body["content"] = self.text[self.num_sent:]
        self.num_sent = len(self.text)
        return body
