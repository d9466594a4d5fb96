"""Writing one prepared request's answer from its engine outputs (`RequestStream`): whole, or as
server-sent events.

- Whole (`whole_response`): wait until every engine request of the HTTP request has finished,
  then answer one JSON body, choices in order (prompt i's samples are choices i x n .. i x n +
  n - 1) and the usage.
- Streaming (`stream_response`): first the chat role (or, for completions with echo, the
  prompts); then one chunk per choice whenever the engine produced new text (without logprobs,
  tokens whose text is not complete yet, a split UTF-8 character, wait for the next); then the
  usage if asked for, and `data: [DONE]`.
- A sequence the engine failed (`CompletionOutput.error`, or an EngineError from the stream)
  fails the HTTP request: an EngineError (EngineDeadError, so 503, once the engine is dead) for
  a whole response, an error event in a stream. A client that goes away ends the stream quietly;
  the handler then aborts what is unfinished.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from engine.frontends.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineError,
    RequestStream,
)
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.prepare import Job
from entrypoints.openai.responses import (
    ChoiceCursor,
    TokenTexts,
    advance,
    chat_chunk_choice,
    chat_logprobs,
    chat_message_choice,
    completion_choice,
    completion_logprobs,
    envelope,
    join_completion_logprobs,
    prompt_completion_logprobs,
    tool_finish_reason,
    usage,
    vllm_prompt_logprobs,
)
from entrypoints.openai.tools import ToolStreamer, parse_tool_output

logger = logging.getLogger(__name__)


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class ResponseWriter:
    """Writes answers for one server; `async_engine` says whether a failure is the engine's death."""

    def __init__(self, async_engine: AsyncLLMEngine, token_texts: TokenTexts):
        self.async_engine = async_engine
        self.token_texts = token_texts

    def _failure(self, error: str) -> EngineError:
        """The exception for a sequence the engine failed: EngineDeadError if the engine died."""
        dead = self.async_engine.dead_reason
        if dead is not None:
            return EngineDeadError(f"the engine is dead: {dead} (this request: {error})")
        return EngineError(f"engine error: {error}")

    def _choice_index(self, job: Job, stream: RequestStream, request_id: str, sample_index: int) -> int:
        return stream.request_ids.index(request_id) * job.params.n + sample_index

    def _prompt_parts(self, job: Job, index: int, scored) -> tuple[dict | None, list | None]:
        """A choice's prompt scoring: (the legacy logprobs of the echoed prompt, vLLM's
        prompt_logprobs), each None unless asked for."""
        if scored is None:
            return None, None
        prompt_ids = job.prompt_ids[index // job.params.n]
        echoed = (prompt_completion_logprobs(self.token_texts, prompt_ids, scored, job.params.logprobs)
                  if job.echo_logprobs else None)
        listed = (vllm_prompt_logprobs(self.token_texts, prompt_ids, scored, job.params.prompt_logprobs)
                  if job.return_prompt_logprobs else None)
        return echoed, listed

    async def whole_response(self, job: Job, stream: RequestStream) -> web.Response:
        finals = {}
        scored = {}  # request_id -> RequestOutput.prompt_logprobs
        while not stream.done:
            for request_id, output in (await stream.next_outputs()).items():
                if getattr(output, "prompt_logprobs", None) is not None:
                    scored[request_id] = output.prompt_logprobs
                for completion in output.outputs:
                    if getattr(completion, "error", None) is not None:
                        raise self._failure(completion.error)
                    finals[self._choice_index(job, stream, request_id, completion.index)] = completion
        choices = []
        for index in sorted(finals):
            completion = finals[index]
            cursor = ChoiceCursor()
            delta = advance(cursor, completion)
            num_top = job.params.logprobs
            if job.chat:
                logprobs = chat_logprobs(self.token_texts, delta, num_top) if job.chat_logprobs else None
                content, calls = delta.text, None
                if job.tools is not None:
                    content, calls = parse_tool_output(job.tools, delta.text)
                choices.append(chat_message_choice(index, content, logprobs, delta, calls))
            else:
                text = delta.text
                if job.echo_texts is not None:
                    cursor.text_offset = len(job.echo_texts[index // job.params.n])
                    text = job.echo_texts[index // job.params.n] + text
                logprobs = completion_logprobs(self.token_texts, cursor, delta, num_top) if num_top is not None else None
                echoed, listed = self._prompt_parts(
                    job, index, scored.get(stream.request_ids[index // job.params.n]))
                if echoed is not None:
                    logprobs = join_completion_logprobs(echoed, logprobs)
                choice = completion_choice(index, text, logprobs, delta)
                if listed is not None:
                    choice["prompt_logprobs"] = listed
                choices.append(choice)
        num_generated = sum(len(c.token_ids) for c in finals.values())
        body = envelope(job.response_id, "chat.completion" if job.chat else "text_completion", int(time.time()),
                        job.model, choices, usage=usage(sum(map(len, job.prompt_ids)), num_generated))
        return web.json_response(body)

    async def stream_response(self, request: web.Request, job: Job, stream: RequestStream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        extra = {"usage": None} if job.include_usage else {}
        chunk = lambda choices: _sse(envelope(job.response_id, obj, created, job.model, choices, **extra))
        num_choices = len(job.prompt_ids) * job.params.n
        cursors = {index: ChoiceCursor() for index in range(num_choices)}
        tool_streams = ({index: ToolStreamer(job.tools) for index in range(num_choices)}
                        if job.chat and job.tools is not None else {})
        num_generated: dict[int, int] = {}
        try:
            if job.chat:
                first = [chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None) for i in range(num_choices)]
                await response.write(chunk(first).encode())
            elif job.echo_texts is not None and job.params.prompt_logprobs is None:
                for i in range(num_choices):
                    cursors[i].text_offset = len(job.echo_texts[i // job.params.n])
                echoed = [completion_choice(i, job.echo_texts[i // job.params.n], None, None) for i in range(num_choices)]
                await response.write(chunk(echoed).encode())
            # A scored prompt (echo with logprobs, prompt_logprobs) goes out with the first output
            # that carries it: choices not sent yet.
            index_of_echo = set(range(num_choices)) if job.params.prompt_logprobs is not None else None
            failed = False
            while not stream.done and not failed:
                try:
                    outputs = await stream.next_outputs()
                except EngineError as exc:
                    outputs, failed = {}, True
                    status = 503 if isinstance(exc, EngineDeadError) else 500
                    error = ProtocolError(str(exc), status=status, type="server_error")
                    await response.write(_sse(error.to_dict()).encode())
                parts = []
                for request_id, output in outputs.items():
                    if index_of_echo is not None and getattr(output, "prompt_logprobs", None) is not None:
                        parts += self._echo_scored(job, stream, request_id, output, cursors, index_of_echo, chunk)
                    for completion in output.outputs:
                        if getattr(completion, "error", None) is not None and not failed:
                            failed = True
                            exc = self._failure(completion.error)
                            status = 503 if isinstance(exc, EngineDeadError) else 500
                            parts.append(_sse(ProtocolError(str(exc), status=status, type="server_error").to_dict()))
                        if failed:
                            continue
                        index = self._choice_index(job, stream, request_id, completion.index)
                        delta = advance(cursors[index], completion)
                        if delta is None:
                            continue
                        if not delta.text and delta.finish_reason is None and job.params.logprobs is None:
                            continue  # tokens whose text is not complete yet (a split UTF-8 character)
                        num_generated[index] = len(completion.token_ids)
                        choice = self._chunk_choice(job, index, cursors[index], delta, tool_streams.get(index))
                        if choice is not None:
                            parts.append(chunk([choice]))
                if parts:
                    await response.write("".join(parts).encode())
            if job.include_usage and not failed:
                prompt_tokens = sum(map(len, job.prompt_ids))
                body = envelope(job.response_id, obj, created, job.model, [],
                                usage=usage(prompt_tokens, sum(num_generated.values())))
                await response.write(_sse(body).encode())
            await response.write(_sse("[DONE]").encode())
            await response.write_eof()
        except ConnectionError:  # the client went away; _generate's finally aborts its requests
            logger.info("client disconnected from %s", job.response_id)
        return response

    def _echo_scored(self, job: Job, stream: RequestStream, request_id: str, output, cursors, pending: set,
                     chunk) -> list[str]:
        parts = []
        for sample in range(job.params.n):
            index = self._choice_index(job, stream, request_id, sample)
            if index not in pending:
                continue
            pending.discard(index)
            echoed, listed = self._prompt_parts(job, index, output.prompt_logprobs)
            text = ""
            if job.echo_texts is not None:
                text = job.echo_texts[index // job.params.n]
                cursors[index].text_offset = len(text)
            choice = completion_choice(index, text, echoed, None)
            if listed is not None:
                choice["prompt_logprobs"] = listed
            parts.append(chunk([choice]))
        return parts

    def _chunk_choice(self, job: Job, index: int, cursor: ChoiceCursor, delta, tools: ToolStreamer | None) -> dict | None:
        num_top = job.params.logprobs
        if job.chat:
            logprobs = chat_logprobs(self.token_texts, delta, num_top) if job.chat_logprobs and delta.token_ids else None
            finish_reason = delta.finish_reason
            if tools is not None:
                body = tools.feed(delta.text, delta.finish_reason is not None)
                if tools.has_calls:
                    finish_reason = tool_finish_reason(finish_reason)
                if not body and finish_reason is None and logprobs is None:
                    return None  # held back: it may still become a tool call
            else:
                body = {"content": delta.text} if delta.text else {}
            return chat_chunk_choice(index, body, logprobs, finish_reason)
        logprobs = completion_logprobs(self.token_texts, cursor, delta, num_top) if num_top is not None else None
        return completion_choice(index, delta.text, logprobs, delta)
