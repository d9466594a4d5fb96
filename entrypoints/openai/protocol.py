"""OpenAI request parsing and validation, by hand: JSON body -> a request dataclass with SamplingParams.

Every problem is a ProtocolError (errors.py) carrying the HTTP status, OpenAI's error `type` and
`code`, and the `param` (the field) at fault, so the server answers `{"error": {message, type,
param, code}}`.
Unknown fields are accepted and ignored (OpenAI clients send extras such as `user`); known fields
are type- and range-checked against the one table of bounds, `engine.sampling_params.BOUNDS`
(what the device arrays hold), and a `ParamError` from there becomes a 400 naming its `param`.
Strings must be valid Unicode (a lone surrogate such as "\\ud800" is refused: it cannot be
encoded, tokenized or sent back). Server limits (`RequestLimits`: most prompts, most n) come from
the server's config. Constraint fields (response_format, structured_outputs, logit_bias,
allowed_token_ids, bad_words) are read in constraints.py, tools and tool_choice in tools.py.
Features this engine does not have (suffix, legacy functions, best_of > n) are rejected by name
rather than silently ignored. `echo` with `logprobs`, and vLLM's `prompt_logprobs`, score the
prompt (SamplingParams.prompt_logprobs). Response bodies are built in
`entrypoints/openai/responses.py`.
"""

from __future__ import annotations

import dataclasses
import json

from engine.errors import ParamError
from engine.sampling_params import (
    BOUNDS,
    INT32_MAX,
    MAX_N,
    SamplingParams,
    check_bound,
    check_stop_strings,
    kind_of,
)
from entrypoints.openai.constraints import parse_constraints
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.tools import ToolPlan, forced_grammar, parse_tools

MAX_PROMPTS = 64  # prompts in one /v1/completions request
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What this server accepts in one request (server knobs, below the table's hard bounds)."""

    max_prompts: int = MAX_PROMPTS  # prompts in one /v1/completions request
    max_n: int = MAX_N  # samples per prompt


@dataclasses.dataclass
class CompletionRequest:
    model: str | None  # as sent; None when absent (the served model is meant)
    prompts: list[str | list[int]]  # one engine request per prompt
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage
    echo: bool  # prepend the prompt to the returned text
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was sent


@dataclasses.dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]  # normalized: {"role": str, "content": str}
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool  # return chat logprobs (params.logprobs is the number of top ones)
    add_generation_prompt: bool
    tools: ToolPlan | None = None  # tools and tool_choice, when tools were sent


# ---- field readers -------------------------------------------------------------------------

_type_name = kind_of


def _bounded(body: dict, name: str, default=None, *, bound: str | None = None):
    """A numeric field checked against BOUNDS[bound or name]; an integral float is an integer."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    key = bound or name
    if BOUNDS[key].kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        return check_bound(key, value, param=name)
    except ParamError as exc:
        raise ProtocolError.from_param_error(exc) from None


def _bool(body: dict, name: str, default: bool | None = False):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {_type_name(value)}", param=name)
    return value


def check_text(value: str, param: str) -> str:
    """A string that UTF-8 can hold: JSON may carry lone surrogates ("\\ud800"), Python keeps
    them, and every tokenizer, stop-string scan and response write would fail on them later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"'{param}' is not valid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) "
                            f"at character {exc.start}", param=param) from None
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ProtocolError(f"'stop' must be a string or an array of strings, got {_type_name(value)}", param="stop")
    try:
        stop = check_stop_strings(value)
    except ParamError as exc:
        raise ProtocolError.from_param_error(exc) from None
    for item in stop:
        check_text(item, "stop")
    return stop


def _token_id_list(value, name: str) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError(f"'{name}' must be an array of non-negative integer token ids", param=name)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            try:
                check_bound("prompt_token_ids", t, param=name)
            except ParamError as exc:
                raise ProtocolError(f"'{name}' must be an array of non-negative integer token ids: {exc}",
                                    param=name) from None
    return value


def _unsupported(body: dict, *, chat: bool) -> None:
    if body.get("suffix") is not None:
        raise ProtocolError("'suffix' is not supported", param="suffix")
    if body.get("functions"):
        raise ProtocolError("'functions' (legacy function calling) is not supported; send 'tools'", param="functions")
    if not chat and (body.get("tools") or body.get("tool_choice") is not None):
        param = "tools" if body.get("tools") else "tool_choice"
        raise ProtocolError(f"'{param}' is only supported on chat completions", param=param)


def _model(body: dict, served_names: tuple[str, ...]) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise ProtocolError(f"'model' must be a string, got {_type_name(model)}", param="model")
    if model not in served_names:
        raise ProtocolError(f"The model {model[:100]!r} does not exist; this server serves {', '.join(served_names)}",
                            param="model", status=404, code="model_not_found")
    return model


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ProtocolError(f"'stream_options' must be an object, got {_type_name(options)}", param="stream_options")
    if not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return stream, _bool(options, "include_usage")


def _sampling(body: dict, limits: RequestLimits, *, max_tokens, logprobs, prompt_logprobs=None) -> SamplingParams:
    n = _bounded(body, "n", 1)
    if n > limits.max_n:
        raise ProtocolError(f"'n' must be <= {limits.max_n} on this server, got {n}", param="n")
    best_of = _bounded(body, "best_of", None, bound="n")
    if best_of is not None and best_of != n:
        raise ProtocolError("'best_of' different from 'n' is not supported", param="best_of")
    values = dict(
        n=n,
        max_tokens=max_tokens,
        temperature=_bounded(body, "temperature", 1.0),
        top_p=_bounded(body, "top_p", 1.0),
        top_k=_bounded(body, "top_k", -1),
        min_p=_bounded(body, "min_p", 0.0),
        presence_penalty=_bounded(body, "presence_penalty", 0.0),
        frequency_penalty=_bounded(body, "frequency_penalty", 0.0),
        repetition_penalty=_bounded(body, "repetition_penalty", 1.0),
        seed=_bounded(body, "seed", None),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        **parse_constraints(body),
    )
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        values["stop_token_ids"] = tuple(_token_id_list(stop_token_ids, "stop_token_ids"))
        if len(values["stop_token_ids"]) > 1024:
            raise ProtocolError("'stop_token_ids' may hold at most 1024 ids", param="stop_token_ids")
    try:
        return SamplingParams(**values)
    except ParamError as exc:
        raise ProtocolError.from_param_error(exc) from None


def _require_object(body) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


# ---- requests ------------------------------------------------------------------------------

def parse_completion_request(body, served_names: tuple[str, ...],
                             limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    body = _require_object(body)
    model = _model(body, served_names)
    _unsupported(body, chat=False)
    prompts = _prompts(body.get("prompt", _MISSING), limits)
    stream, include_usage = _stream(body)
    max_tokens = _bounded(body, "max_tokens", 16)
    logprobs = _bounded(body, "logprobs", None)
    echo = _bool(body, "echo")
    # vLLM's prompt_logprobs (returned per choice); `echo` with `logprobs` also scores the
    # prompt, shown in the logprobs object ahead of the generated tokens, as OpenAI does.
    prompt_logprobs = _bounded(body, "prompt_logprobs", None, bound="logprobs")
    if echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    params = _sampling(body, limits, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    return CompletionRequest(model, prompts, params, stream, include_usage, echo=echo,
                             return_prompt_logprobs=body.get("prompt_logprobs") is not None)


def _prompts(value, limits: RequestLimits) -> list[str | list[int]]:
    if value is _MISSING or value is None:
        raise ProtocolError("'prompt' is required", param="prompt")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and not isinstance(value[0], str | list):
        value = [value]  # one prompt of token ids (each entry is checked below)
    if not isinstance(value, list) or not value:
        raise ProtocolError("'prompt' must be a string, an array of strings, an array of token ids or an array "
                            "of token id arrays, and not empty", param="prompt")
    if len(value) > limits.max_prompts:
        raise ProtocolError(f"'prompt' may hold at most {limits.max_prompts} prompts, got {len(value)}",
                            param="prompt")
    if len({type(item) for item in value}) > 1:
        raise ProtocolError("'prompt' must not mix strings and token id arrays", param="prompt")
    prompts: list[str | list[int]] = []
    for item in value:
        if isinstance(item, str):
            if not item:
                raise ProtocolError("'prompt' must not be empty", param="prompt")
            prompts.append(check_text(item, "prompt"))
        elif isinstance(item, list) and item:
            prompts.append(_token_id_list(item, "prompt"))
        else:
            raise ProtocolError("'prompt' entries must be non-empty strings or non-empty arrays of token ids",
                                param="prompt")
    return prompts


def parse_chat_request(body, served_names: tuple[str, ...],
                       limits: RequestLimits = RequestLimits()) -> ChatRequest:
    body = _require_object(body)
    model = _model(body, served_names)
    _unsupported(body, chat=True)
    tools = parse_tools(body)
    messages = _messages(body.get("messages", _MISSING))
    stream, include_usage = _stream(body)
    max_tokens = _bounded(body, "max_completion_tokens", None, bound="max_tokens")
    if max_tokens is None:
        max_tokens = _bounded(body, "max_tokens", None)
    want_logprobs = _bool(body, "logprobs")
    top_logprobs = _bounded(body, "top_logprobs", None, bound="logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    params = _sampling(body, limits, max_tokens=max_tokens,
                       logprobs=(top_logprobs or 0) if want_logprobs else None)
    if tools is not None and tools.forced:
        if params.structured_outputs is not None:
            raise ProtocolError("'tool_choice' forces a tool call, which cannot be combined with "
                                "'response_format' / 'structured_outputs'", param="tool_choice")
        params = dataclasses.replace(params, structured_outputs=forced_grammar(tools))
    return ChatRequest(model, messages, params, stream, include_usage, want_logprobs,
                       add_generation_prompt=_bool(body, "add_generation_prompt", True), tools=tools)


def _messages(value) -> list[dict]:
    if value is _MISSING or value is None:
        raise ProtocolError("'messages' is required", param="messages")
    if not isinstance(value, list):
        raise ProtocolError(f"'messages' must be an array, got {_type_name(value)}", param="messages")
    if not value:
        raise ProtocolError("'messages' must not be empty", param="messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ProtocolError(f"'{where}' must be an object, got {_type_name(message)}", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            shown = repr(role[:40]) if isinstance(role, str) else _type_name(role)
            raise ProtocolError(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {shown}",
                                param=f"{where}.role")
        content = message.get("content")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if tool_calls is not None:
            content = (content or "") + _tool_calls_text(tool_calls, where)
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": string}}; "
                                        "other part types are not supported", param=f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ProtocolError(f"'{where}.content' must be a string or an array of text parts, got "
                                f"{_type_name(content)}", param=f"{where}.content")
        check_text(content, f"{where}.content")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ProtocolError(f"'{where}.name' must be a string", param=f"{where}.name")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


def _tool_calls_text(tool_calls, where: str) -> str:
    """An assistant message's earlier tool calls, written in the Hermes format the prompt uses."""
    if not isinstance(tool_calls, list):
        raise ProtocolError(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    parts = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ProtocolError(f"'{where}.tool_calls' entries need function.name", param=f"{where}.tool_calls")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        call_json = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{call_json}\n</tool_call>")
    return "\n".join(parts)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, prompt_param: str) -> None:
    """OpenAI's rule: the prompt plus the requested completion must fit the context."""
    if num_prompt_tokens >= max_model_len:
        raise ProtocolError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens; the "
            f"{prompt_param} has {num_prompt_tokens} tokens, which leaves no room to generate",
            param=prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens; you asked for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {prompt_param}, {max_tokens} "
            "in max_tokens)",
            param="max_tokens",
        )
