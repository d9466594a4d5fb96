"""Chat templates: the checkpoint's Jinja template, rendered the way Hugging Face transformers does.

The environment is sandboxed and immutable (a checkpoint's template is data, not trusted code), uses
`trim_blocks`/`lstrip_blocks` and the `loopcontrols` extension, and provides the helpers templates in
the wild call: `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII characters. The
`{% generation %}` block (used by templates to mark assistant text for training masks) renders its
body unchanged.

`render_chat_pieces` renders the same conversation split into template text and message contents,
so a tokenizer can encode the two differently: the template's own special tokens ("<|im_start|>")
stay special, while the same characters typed into a message stay plain text (a user cannot forge
a system turn). It renders with a unique placeholder in place of each content and checks that
putting the contents back gives exactly the plain rendering; a template that transforms contents
(trims, slices, escapes them) cannot be split that way and yields None.
"""

import datetime
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or it raised while rendering (e.g. via raise_exception)."""


class ChatContentError(ChatTemplateError):
    """A message's content cannot be kept as plain text under this template; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def validate_messages(messages: Any) -> None:
    """ValueError naming the first problem: not a list, a message not a dict, bad role or content."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r} field")
            if not isinstance(message[key], str):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}"
                )


def render_chat_template(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    **kwargs: Any,
) -> str:
    """Render `messages` (already validated); `special_tokens` supplies bos_token, eos_token, ..."""
    variables = dict(special_tokens)
    variables.update(kwargs)
    variables["messages"] = [dict(m) for m in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return template.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"rendering the chat template failed: {e}") from e


def render_chat_pieces(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    rendered: str,
    **kwargs: Any,
) -> list[tuple[str, bool]] | None:
    """`rendered` (the plain rendering of `messages`) as (text, is_content) pieces, or None when
    the template does not copy contents verbatim. Pieces joined equal `rendered`."""
    nonce = uuid.uuid4().hex
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    marked = [dict(m, content=marks[i]) for i, m in enumerate(messages)]
    try:
        skeleton = render_chat_template(template, marked, add_generation_prompt, special_tokens, **kwargs)
    except ChatTemplateError:
        return None  # the template looks at contents (e.g. raises on a marker): no split
    pattern = re.compile("\ue000" + nonce + ":(\\d+)\ue001")
    pieces: list[tuple[str, bool]] = []
    at = 0
    for match in pattern.finditer(skeleton):
        if match.start() > at:
            pieces.append((skeleton[at:match.start()], False))
        content = messages[int(match.group(1))]["content"]
        if content:
            pieces.append((content, True))
        at = match.end()
    if at < len(skeleton):
        pieces.append((skeleton[at:], False))
    if "".join(text for text, _ in pieces) != rendered:
        return None
    return pieces
