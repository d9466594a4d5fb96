"""Turning a raw HTTP body into a `Job` the engine can run; this runs on the server's worker
threads, never on the event loop (a 1 MB prompt takes a noticeable time to parse and tokenize).

1. Parse the JSON (a body nested too deeply, or holding a 5000-digit integer, is a 400).
2. Validate it into a request (`protocol`), with this server's limits.
3. Refuse what could never be admitted, whatever the load: more sequences (prompts x n) than
   max_queue_len, more logprobs than the engine keeps.
4. Tokenize: prompts as they are, chat through the template (`encode_chat`: text in a message never
   becomes a control token unless the server trusts its clients); token-id prompts are checked
   against the vocabulary; prompt + max_tokens must fit max_model_len (a tokenizer that takes
   `max_num_tokens` stops counting there, so a huge prompt never becomes a huge list of ids).
5. Structured output (response_format, structured_outputs, a forced tool call): compile the
   grammar here, through the engine's GrammarCompiler and its LRU, so the step thread never
   waits on llguidance; a grammar that does not compile is a 400 naming the field. Tools are
   shown to the model (the chat template's `tools`, or a Hermes-style system message, tools.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import uuid

from engine.errors import ParamError
from engine.sampling_params import SamplingParams
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.protocol import (
    RequestLimits,
    check_context,
    check_text,
    parse_chat_request,
    parse_completion_request,
)
from entrypoints.openai.tools import (
    ToolPlan,
    hermes_system_prompt,
    template_tools,
    tool_check_grammars,
)


@dataclasses.dataclass
class Job:
    """One validated HTTP generation request, ready for the engine."""

    chat: bool
    response_id: str  # also the engine group_id of all its prompts
    model: str
    prompt_ids: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat_logprobs: bool = False
    echo_texts: list[str] | None = None
    echo_logprobs: bool = False  # `echo` with `logprobs`: the prompt's tokens lead the logprobs
    return_prompt_logprobs: bool = False  # vLLM's per-choice prompt_logprobs
    prompt_param: str = "prompt"
    grammar: object = None  # the compiled structured-output grammar (engine CompiledGrammar)
    tools: ToolPlan | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.prompt_ids) * self.params.n


def vocab_size_of(engine) -> int | None:
    """The ids a prompt may hold: what the engine samples over, else the tokenizer's vocabulary."""
    runner = getattr(engine, "runner", None)
    return getattr(runner, "sample_vocab_size", None) or getattr(engine.tokenizer, "vocab_size", None)


def encode_chat(tokenizer, messages, add_generation_prompt: bool, trusted: bool, **template_vars) -> list[int]:
    """The chat prompt's ids; tokenizers without `encode_chat` render and encode the text."""
    method = getattr(tokenizer, "encode_chat", None)
    if method is not None:
        return method(messages, add_generation_prompt, special_tokens_in_content=trusted, **template_vars)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_vars)
    return tokenizer.encode(text, add_special_tokens=False)


def parse_json(raw: bytes):
    try:
        return json.loads(raw)
    except RecursionError:
        raise ProtocolError("The request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise ProtocolError(f"The request body is not valid JSON: {str(exc)[:200]}") from None


@dataclasses.dataclass
class Preparer:
    """What preparing needs to know of the engine and the server; thread-safe (read-only)."""

    tokenizer: object
    max_model_len: int
    vocab_size: int | None
    max_logprobs: int | None
    served_names: tuple[str, ...]
    model_name: str
    limits: RequestLimits
    max_queue_len: int | None
    trust_chat_special_tokens: bool = False
    # StructuredOutputsParams -> CompiledGrammar (the engine's compile_grammar); None: validate only
    grammar_compiler: object = None

    def __post_init__(self) -> None:
        try:
            parameters = inspect.signature(self.tokenizer.encode).parameters
        except (TypeError, ValueError):
            parameters = {}
        # Tokenizers that can stop at a token count (text.Tokenizer) refuse a huge prompt before
        # its ids become a Python list; the others encode it all and check_context refuses it.
        self._can_limit = "max_num_tokens" in parameters

    def _encode_prompt(self, prompt: str, max_tokens: int | None) -> list[int]:
        if not self._can_limit:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=True, max_num_tokens=self.max_model_len - 1)
        except ValueError as exc:
            num_tokens = getattr(exc, "num_tokens", None)
            if num_tokens is None:
                raise
        check_context(num_tokens, max_tokens, self.max_model_len, prompt_param="prompt")
        raise AssertionError("check_context refuses a prompt of max_model_len tokens")

    def _check_admission(self, num_prompts: int, params: SamplingParams, prompt_param: str) -> None:
        """400 for a request that could never be admitted, whatever the load."""
        if self.max_logprobs is not None and params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ProtocolError(f"the number of logprobs must be <= {self.max_logprobs} on this server, got "
                                f"{params.logprobs}", param="top_logprobs" if prompt_param == "messages" else "logprobs")
        num_seqs = num_prompts * params.n
        limit = self.max_queue_len
        if limit is not None and num_seqs > limit:
            raise ProtocolError(
                f"This request needs {num_seqs} sequences ({num_prompts} prompt(s) x n={params.n}), more than this "
                f"server ever queues (max_queue_len={limit}); send fewer prompts or a smaller n",
                param="n" if params.n > 1 else prompt_param, code="request_too_large")

    def _grammar(self, params: SamplingParams, tools: ToolPlan | None = None):
        """The request's compiled grammar (None without structured output); 400 naming the field."""
        try:
            if tools is not None and tools.choice != "none":
                for check in tool_check_grammars(tools):
                    self._compile(check)
            if params.structured_outputs is None:
                return None
            return self._compile(params.structured_outputs)
        except ParamError as exc:
            raise ProtocolError(str(exc), param=exc.param) from None

    def _compile(self, structured_outputs):
        if self.grammar_compiler is not None:
            return self.grammar_compiler(structured_outputs)
        from engine.structured_output.compiler import check_grammar_text

        check_grammar_text(structured_outputs)  # no tokenizer: validation only
        return None

    def _chat_messages(self, messages: list[dict], tools: ToolPlan | None) -> tuple[list[dict], dict]:
        """Messages and template variables that show the tools to the model."""
        if tools is None or tools.choice == "none" or not tools.tools:
            return messages, {}
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if "tools" in template:
            return messages, {"tools": template_tools(tools)}
        prompt = hermes_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]], {}
        return [{"role": "system", "content": prompt}, *messages], {}

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        if vocab is not None:
            for t in ids:
                if t >= vocab:
                    raise ProtocolError(f"'prompt' holds the token id {t}, outside the vocabulary [0, {vocab})",
                                        param="prompt")

    def completion(self, raw: bytes) -> Job:
        req = parse_completion_request(parse_json(raw), self.served_names, self.limits)
        self._check_admission(len(req.prompts), req.params, "prompt")
        prompt_ids = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                ids = self._encode_prompt(prompt, req.params.max_tokens)
            else:
                ids = prompt
                self._check_ids(ids)
            check_context(len(ids), req.params.max_tokens, self.max_model_len, prompt_param="prompt")
            prompt_ids.append(ids)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in req.prompts]
        grammar = self._grammar(req.params)
        return Job(chat=False, response_id=f"cmpl-{uuid.uuid4().hex}", model=req.model or self.model_name,
                   prompt_ids=prompt_ids, params=req.params, stream=req.stream,
                   include_usage=req.include_usage, echo_texts=echo, grammar=grammar,
                   echo_logprobs=req.echo and req.params.logprobs is not None,
                   return_prompt_logprobs=req.return_prompt_logprobs)

    def chat(self, raw: bytes) -> Job:
        req = parse_chat_request(parse_json(raw), self.served_names, self.limits)
        self._check_admission(1, req.params, "messages")
        grammar = self._grammar(req.params, req.tools)  # before rendering: a bad grammar is the error
        messages, template_vars = self._chat_messages(req.messages, req.tools)
        try:
            ids = encode_chat(self.tokenizer, messages, req.add_generation_prompt, self.trust_chat_special_tokens,
                              **template_vars)
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception is the client's error
            param = getattr(exc, "param", None) or "messages"
            raise ProtocolError(f"'messages' could not be rendered by the chat template: {str(exc)[:300]}",
                                param=param) from None
        check_context(len(ids), req.params.max_tokens, self.max_model_len, prompt_param="messages")
        return Job(chat=True, response_id=f"chatcmpl-{uuid.uuid4().hex}", model=req.model or self.model_name,
                   prompt_ids=[ids], params=req.params, stream=req.stream, include_usage=req.include_usage,
                   chat_logprobs=req.logprobs, prompt_param="messages", grammar=grammar, tools=req.tools)


def tokenize_body(preparer: Preparer, raw: bytes) -> dict:
    """vLLM's POST /tokenize: {"prompt", "add_special_tokens"} or {"messages",
    "add_generation_prompt"} -> {"count", "max_model_len", "tokens"}."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if "messages" in body:
        req = parse_chat_request({**body, "max_tokens": None, "stream": False}, preparer.served_names,
                                 preparer.limits)
        messages, template_vars = preparer._chat_messages(req.messages, req.tools)
        try:
            ids = encode_chat(preparer.tokenizer, messages, req.add_generation_prompt,
                              preparer.trust_chat_special_tokens, **template_vars)
        except Exception as exc:  # noqa: BLE001 - the template's own error is the client's
            raise ProtocolError(f"'messages' could not be rendered by the chat template: {str(exc)[:300]}",
                                param="messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ProtocolError("'prompt' must be a string (or send 'messages')", param="prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise ProtocolError("'add_special_tokens' must be a boolean", param="add_special_tokens")
        ids = preparer.tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=add_special)
    return {"count": len(ids), "max_model_len": preparer.max_model_len, "tokens": ids}


def detokenize_body(preparer: Preparer, raw: bytes) -> dict:
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    tokens = body.get("tokens")
    vocab = preparer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               and (vocab is None or t < vocab) for t in tokens):
        raise ProtocolError(f"'tokens' must be an array of token ids in [0, {vocab})", param="tokens")
    return {"prompt": preparer.tokenizer.decode(tokens)}
