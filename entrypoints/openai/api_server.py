"""The OpenAI-compatible HTTP server (aiohttp) around an LLMEngine.

What happens to a request:

1. Middleware: /v1 routes need the bearer token when an API key is set (401), get 503 while the
   server drains after SIGTERM, and are counted in flight; any exception becomes an OpenAI error
   body (ProtocolError -> its status, anything unexpected -> 500), so one bad request never takes
   the server down.
2. The handler parses and validates the body (`protocol`), tokenizes the prompt (through the
   chat template for chat) and checks it against max_model_len, all on the event loop, so bad input
   never reaches the step thread.
3. If the engine's waiting queue plus the adds not yet handed over would exceed max_queue_len, 503
   with Retry-After at once. Otherwise one engine request per prompt goes to the AsyncLLMEngine.
4. Streaming: server-sent events, one chunk per choice whenever the engine produced new text,
   ending with `data: [DONE]`. Whole: wait for the last outputs, answer one JSON body.
5. However the handler ends (finished, client gone and the handler cancelled, write failed,
   error), its unfinished engine requests are aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import signal
import time
import uuid

from aiohttp import web

from engine.async_engine import AsyncLLMEngine, EngineError, RequestStream
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from entrypoints.openai.protocol import (
    ProtocolError,
    check_context,
    param_of,
    parse_chat_request,
    parse_completion_request,
)
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
    usage,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed at start-up)
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # None: the engine's model_name
    max_queue_len: int | None = None  # most waiting requests before 503; None: unbounded
    shutdown_grace_s: float = 30.0  # after SIGTERM, how long in-flight requests may take to finish


@dataclasses.dataclass
class _Job:
    """One validated HTTP generation request, ready for the engine."""

    chat: bool
    response_id: str
    model: str
    prompt_ids: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat_logprobs: bool = False
    echo_texts: list[str] | None = None
    prompt_param: str = "prompt"


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIServer:
    def __init__(self, engine, config: ServerConfig):
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = config.served_model_name or engine.model_name
        self.served_names = tuple(dict.fromkeys((self.model_name, engine.model_name)))
        self.metrics = ServerMetrics()
        self.async_engine = AsyncLLMEngine(engine, max_queue_len=config.max_queue_len, metrics=self.metrics)
        self.token_texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        self.draining = False
        self.num_in_flight = 0

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=8 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        return app

    # ---- middleware and small routes -------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        is_api = request.path.startswith("/v1/")
        counted = is_api and request.method == "POST"
        if counted:
            self.num_in_flight += 1
        try:
            if is_api:
                self._check_auth(request)
            if counted and self.draining:
                raise ProtocolError("The server is shutting down", status=503, type="server_error",
                                    code="shutting_down", headers={"Retry-After": "5"})
            response = await handler(request)
        except ProtocolError as exc:
            response = web.json_response(exc.to_dict(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            error = ProtocolError(exc.reason, status=exc.status, type="invalid_request_error")
            response = web.json_response(error.to_dict(), status=exc.status)
        except Exception:  # noqa: BLE001 - answer 500 and keep serving
            logger.exception("unhandled error in %s %s", request.method, request.path)
            error = ProtocolError("Internal server error", status=500, type="server_error")
            response = web.json_response(error.to_dict(), status=500)
        finally:
            if counted:
                self.num_in_flight -= 1
        if is_api:
            self.metrics.observe_http_response(response.status)
        return response

    def _check_auth(self, request: web.Request) -> None:
        if not self.config.api_key:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise ProtocolError("Missing or incorrect API key: send 'Authorization: Bearer <api_key>'",
                                status=401, code="invalid_api_key")

    async def _health(self, request: web.Request) -> web.Response:
        if self.draining or not self.async_engine.is_alive:
            return web.json_response({"status": "unavailable"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.async_engine.stats(), num_pending=self.async_engine.num_pending())
        return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "max_model_len": self.max_model_len} for name in self.served_names]
        return web.json_response({"object": "list", "data": data})

    # ---- generation ------------------------------------------------------------------------

    async def _body(self, request: web.Request):
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"The request body is not valid JSON: {exc}") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await self._body(request), self.served_names)
        prompt_ids = []
        for prompt in req.prompts:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            check_context(len(ids), req.params.max_tokens, self.max_model_len, prompt_param="prompt")
            prompt_ids.append(ids)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in req.prompts] if req.echo else None
        job = _Job(chat=False, response_id=f"cmpl-{uuid.uuid4().hex}", model=req.model or self.model_name,
                   prompt_ids=prompt_ids, params=req.params, stream=req.stream,
                   include_usage=req.include_usage, echo_texts=echo)
        return await self._generate(request, job)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await self._body(request), self.served_names)
        try:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception is the client's error
            raise ProtocolError(f"'messages' could not be rendered by the chat template: {exc}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        check_context(len(ids), req.params.max_tokens, self.max_model_len, prompt_param="messages")
        job = _Job(chat=True, response_id=f"chatcmpl-{uuid.uuid4().hex}", model=req.model or self.model_name,
                   prompt_ids=[ids], params=req.params, stream=req.stream, include_usage=req.include_usage,
                   chat_logprobs=req.logprobs, prompt_param="messages")
        return await self._generate(request, job)

    async def _generate(self, request: web.Request, job: _Job) -> web.StreamResponse:
        if self.async_engine.queue_is_full(len(job.prompt_ids)):
            raise ProtocolError("The server is overloaded (the waiting queue is full); retry later",
                                status=503, type="server_error", code="queue_full", headers={"Retry-After": "1"})
        stream = self.async_engine.new_stream()
        try:
            for i, ids in enumerate(job.prompt_ids):
                await self.async_engine.add_request(stream, f"{job.response_id}-{i}", ids, job.params)
            if job.stream:
                return await self._stream_response(request, job, stream)
            return await self._whole_response(job, stream)
        except ValueError as exc:  # the engine rejected a prompt
            param = param_of(exc)
            raise ProtocolError(str(exc), param=job.prompt_param if param in (None, "prompt") else param) from None
        except EngineError as exc:
            raise ProtocolError(str(exc), status=500, type="server_error") from None
        finally:
            stream.abort_unfinished()

    def _choice_index(self, job: _Job, stream: RequestStream, request_id: str, sample_index: int) -> int:
        return stream.request_ids.index(request_id) * job.params.n + sample_index

    async def _whole_response(self, job: _Job, stream: RequestStream) -> web.Response:
        finals = {}
        while not stream.done:
            for request_id, output in (await stream.next_outputs()).items():
                for completion in output.outputs:
                    finals[self._choice_index(job, stream, request_id, completion.index)] = completion
        choices = []
        for index in sorted(finals):
            completion = finals[index]
            cursor = ChoiceCursor()
            delta = advance(cursor, completion)
            num_top = job.params.logprobs
            if job.chat:
                logprobs = chat_logprobs(self.token_texts, delta, num_top) if job.chat_logprobs else None
                choices.append(chat_message_choice(index, delta.text, logprobs, delta))
            else:
                text = delta.text
                if job.echo_texts is not None:
                    cursor.text_offset = len(job.echo_texts[index // job.params.n])
                    text = job.echo_texts[index // job.params.n] + text
                logprobs = completion_logprobs(self.token_texts, cursor, delta, num_top) if num_top is not None else None
                choices.append(completion_choice(index, text, logprobs, delta))
        num_generated = sum(len(c.token_ids) for c in finals.values())
        body = envelope(job.response_id, "chat.completion" if job.chat else "text_completion", int(time.time()),
                        job.model, choices, usage=usage(sum(map(len, job.prompt_ids)), num_generated))
        return web.json_response(body)

    async def _stream_response(self, request: web.Request, job: _Job, stream: RequestStream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        extra = {"usage": None} if job.include_usage else {}
        chunk = lambda choices: _sse(envelope(job.response_id, obj, created, job.model, choices, **extra))
        num_choices = len(job.prompt_ids) * job.params.n
        cursors = {index: ChoiceCursor() for index in range(num_choices)}
        num_generated: dict[int, int] = {}
        try:
            if job.chat:
                first = [chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None) for i in range(num_choices)]
                await response.write(chunk(first).encode())
            elif job.echo_texts is not None:
                for i in range(num_choices):
                    cursors[i].text_offset = len(job.echo_texts[i // job.params.n])
                echoed = [completion_choice(i, job.echo_texts[i // job.params.n], None, None) for i in range(num_choices)]
                await response.write(chunk(echoed).encode())
            failed = False
            while not stream.done:
                try:
                    outputs = await stream.next_outputs()
                except EngineError as exc:
                    error = ProtocolError(str(exc), status=500, type="server_error")
                    await response.write(_sse(error.to_dict()).encode())
                    failed = True
                    break
                parts = []
                for request_id, output in outputs.items():
                    for completion in output.outputs:
                        index = self._choice_index(job, stream, request_id, completion.index)
                        delta = advance(cursors[index], completion)
                        if delta is None:
                            continue
                        if not delta.text and delta.finish_reason is None and job.params.logprobs is None:
                            continue  # tokens whose text is not complete yet (a split UTF-8 character)
                        num_generated[index] = len(completion.token_ids)
                        parts.append(chunk([self._chunk_choice(job, index, cursors[index], delta)]))
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

    def _chunk_choice(self, job: _Job, index: int, cursor: ChoiceCursor, delta) -> dict:
        num_top = job.params.logprobs
        if job.chat:
            logprobs = chat_logprobs(self.token_texts, delta, num_top) if job.chat_logprobs and delta.token_ids else None
            body = {"content": delta.text} if delta.text else {}
            return chat_chunk_choice(index, body, logprobs, delta.finish_reason)
        logprobs = completion_logprobs(self.token_texts, cursor, delta, num_top) if num_top is not None else None
        return completion_choice(index, delta.text, logprobs, delta)

    # ---- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serves until SIGTERM or SIGINT, then drains: new requests get 503, in-flight ones get
        up to shutdown_grace_s to finish, the rest are failed; then returns."""
        loop = asyncio.get_running_loop()
        self.async_engine.start()
        runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else self.config.port
        print(f"jaxserve: serving {self.model_name} on http://{self.config.host}:{port}", flush=True)
        stop, force = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal cuts the grace period short
            loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
        await stop.wait()
        logger.info("shutting down: draining %d in-flight requests", self.num_in_flight)
        self.draining = True
        deadline = loop.time() + self.config.shutdown_grace_s
        while self.num_in_flight and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
        await self.async_engine.shutdown()
        deadline = loop.time() + 2.0
        while self.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await runner.cleanup()
        print("jaxserve: stopped", flush=True)


def run_server(engine, config: ServerConfig) -> None:
    """Blocks serving `engine` until SIGTERM/SIGINT; returns after a clean shutdown."""
    asyncio.run(OpenAIServer(engine, config).serve())
