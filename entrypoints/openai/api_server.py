"""The OpenAI-compatible HTTP server (aiohttp) around an LLMEngine.

What happens to a request:

1. The connection: its request head must arrive within header_timeout_s (http_guard.py; slow
   clients are dropped and counted in /metrics), and what aiohttp's parser refuses is answered in
   OpenAI's error JSON.
2. Middleware: /v1 routes need the bearer token when an API key is set (401), get 503 while the
   server drains after SIGTERM or once the engine is dead (`dead_reason`), and are counted in
   flight; any exception becomes an OpenAI error body (ProtocolError -> its status, anything
   unexpected -> 500), so one bad request never takes the server down.
3. The handler reads the body under body_timeout_s (408 and a closed connection past it) and
   max_body_bytes (413; by default tied to max_model_len). Then, on a worker thread (the event
   loop keeps answering /health and streaming meanwhile), it parses and validates the body
   (`protocol`), tokenizes the prompt (through the chat template for chat: text in a message never
   becomes a control token unless trust_chat_special_tokens) and checks it against the vocabulary
   and max_model_len, so bad input never reaches the step thread.
4. Admission, in sequences (prompts x n), not prompts: a request that could never fit (more
   sequences than max_queue_len) is a 400 that says so; one that does not fit now gets 503 with
   Retry-After. Otherwise one engine request per prompt goes to the AsyncLLMEngine, all with the
   same group_id (the HTTP request's id).
5. Streaming: server-sent events, one chunk per choice whenever the engine produced new text,
   ending with `data: [DONE]`. Whole: wait for the last outputs, answer one JSON body. A sequence
   the engine failed (`CompletionOutput.error`) fails its HTTP request: 500, or an error event.
6. However the handler ends (finished, client gone and the handler cancelled, write failed,
   error), its unfinished engine requests are aborted, which frees their KV blocks.

Fairness (no client starves the rest), in layers:
- Shape: a request holds at most max_prompts prompts and n <= max_n samples each, and prompt +
  max_tokens <= max_model_len; the body is at most max_body_bytes; all else is a 400/413 at once.
- Queue: at most max_queue_len sequences wait (503 + Retry-After beyond; a request that alone
  exceeds it is a 400, never "retry later" forever).
- Seats: one HTTP request is one engine group (group_id = its response id). While requests of
  other groups wait, a group holds at most EngineConfig.max_request_share of the max_num_seqs
  running seats: the scheduler admits another group's request ahead of its queued sequences and,
  with no seat or block free, preempts the newest sequence of a group over its share
  (scheduler/fairness.py). So a 4-token request completes beside a 64-prompt x n=16 one
  (tests/entrypoints/test_server_tiny.py; full size: test_server_fairness.py, -m slow).
- Slow clients: request heads within header_timeout_s, bodies within body_timeout_s (dropped and
  counted); the preparing threads and the event loop never wait on one client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import signal
import time

from aiohttp import web

from engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError, RequestStream
from engine.metrics import ServerMetrics
from engine.sampling_params import MAX_N
from entrypoints.openai.http_guard import GuardedAppRunner
from entrypoints.openai.prepare import Job, Preparer, vocab_size_of
from entrypoints.openai.protocol import MAX_PROMPTS, ProtocolError, RequestLimits
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

# Default body limit: room for a max_model_len prompt at 64 bytes per token (long tokens, JSON
# escapes such as \\uXXXX\\uXXXX) plus 1 MiB for everything else in the body.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_BASE = 1024 * 1024


def default_body_limit(max_model_len: int) -> int:
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed at start-up)
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # None: the engine's model_name
    max_queue_len: int | None = None  # most waiting sequences (prompts x n) before 503; None: unbounded
    max_n: int = MAX_N  # most samples per prompt
    max_prompts: int = MAX_PROMPTS  # most prompts in one /v1/completions request
    max_body_bytes: int | None = None  # request body limit; None: default_body_limit(max_model_len)
    header_timeout_s: float = 10.0  # a request head (line + headers) must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this once its head has
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    num_prepare_threads: int = 2  # threads that parse, render chat templates and tokenize
    trust_chat_special_tokens: bool = False  # chat content may spell control tokens (trusted clients)
    shutdown_grace_s: float = 30.0  # after SIGTERM, how long in-flight requests may take to finish

    def __post_init__(self) -> None:
        for name in ("max_queue_len", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ServerConfig.{name} must be a positive integer or None, got {value!r}")
        for name, high in (("max_n", MAX_N), ("max_prompts", MAX_PROMPTS), ("num_prepare_threads", 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"ServerConfig.{name} must be an integer in [1, {high}], got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"ServerConfig.{name} must be a number >= 0, got {value!r}")


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def _run_detached(fn, raw: bytes):
    """(fn(raw), None) or (None, the exception without its traceback). Dropping the traceback
    here frees the frames' locals (a refused prompt's millions of token ids) on this worker
    thread, instead of on the event loop when the exception is finally released."""
    try:
        return fn(raw), None
    except Exception as exc:  # noqa: BLE001 - re-raised on the event loop
        error = exc
        while error is not None:
            error.__traceback__ = None
            error = error.__context__
        return None, exc


class OpenAIServer:
    def __init__(self, engine, config: ServerConfig):
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = config.served_model_name or engine.model_name
        self.served_names = tuple(dict.fromkeys((self.model_name, engine.model_name)))
        self.preparer = Preparer(
            tokenizer=engine.tokenizer, max_model_len=engine.max_model_len, vocab_size=vocab_size_of(engine),
            max_logprobs=getattr(getattr(engine, "config", None), "max_logprobs", None),
            served_names=self.served_names, model_name=self.model_name,
            limits=RequestLimits(max_prompts=config.max_prompts, max_n=config.max_n),
            max_queue_len=config.max_queue_len, trust_chat_special_tokens=config.trust_chat_special_tokens)
        self.max_body_bytes = config.max_body_bytes or default_body_limit(self.max_model_len)
        self.metrics = ServerMetrics()
        self.async_engine = AsyncLLMEngine(engine, max_queue_len=config.max_queue_len, metrics=self.metrics)
        self.token_texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        self.draining = False
        self.num_in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(config.num_prepare_threads, thread_name_prefix="prepare")

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        return app

    def make_runner(self, app: web.Application | None = None) -> web.AppRunner:
        """The aiohttp runner with this server's connection guards (http_guard.py)."""
        return GuardedAppRunner(
            app or self.build_app(), header_timeout_s=self.config.header_timeout_s or None,
            on_slow=self.metrics.observe_slow_client, on_error_status=self.metrics.observe_http_response,
            handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
            keepalive_timeout=self.config.keepalive_timeout_s, lingering_time=min(2.0, self.config.body_timeout_s))

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
            if counted and self.async_engine.dead_reason is not None:
                raise ProtocolError(f"The engine cannot serve: {self.async_engine.dead_reason}", status=503,
                                    type="server_error", code="engine_dead")
            response = await handler(request)
        except ProtocolError as exc:
            response = web.json_response(exc.to_dict(), status=exc.status, headers=exc.headers)
            if exc.status in (408, 413):
                response.force_close()  # the rest of the body is not worth reading
        except web.HTTPException as exc:  # unknown route, wrong method
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
        dead = self.async_engine.dead_reason
        if dead is not None:
            return web.json_response({"status": "dead", "reason": dead}, status=503)
        if self.draining:
            return web.json_response({"status": "draining", "reason": "the server is shutting down"}, status=503)
        if not self.async_engine.is_alive:
            return web.json_response({"status": "unavailable", "reason": "the engine is not running"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.async_engine.stats(), num_pending=self.async_engine.num_pending())
        return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "max_model_len": self.max_model_len} for name in self.served_names]
        return web.json_response({"object": "list", "data": data})

    # ---- reading the body; preparing it runs on the worker threads (prepare.py) ----------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        too_large = ProtocolError(f"The request body is larger than this server's limit of {limit} bytes "
                                  "(max_body_bytes; by default tied to max_model_len)", status=413,
                                  code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            async with asyncio.timeout(self.config.body_timeout_s or None):
                return await request.read()
        except TimeoutError:
            self.metrics.observe_slow_client("body")
            raise ProtocolError(f"The request body did not arrive within {self.config.body_timeout_s} s",
                                status=408, code="request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def _prepare(self, fn, raw: bytes) -> Job:
        """Runs `fn(raw)` (parse, tokenize, validate) on the worker threads, off the event loop."""
        job, error = await asyncio.get_running_loop().run_in_executor(self._pool, _run_detached, fn, raw)
        if error is not None:
            raise error
        return job

    # ---- generation ------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        job = await self._prepare(self.preparer.completion, await self._read_body(request))
        return await self._generate(request, job)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        job = await self._prepare(self.preparer.chat, await self._read_body(request))
        return await self._generate(request, job)

    async def _generate(self, request: web.Request, job: Job) -> web.StreamResponse:
        if self.async_engine.queue_is_full(job.num_seqs):
            raise ProtocolError("The server is overloaded (the waiting queue is full); retry later",
                                status=503, type="server_error", code="queue_full", headers={"Retry-After": "1"})
        stream = self.async_engine.new_stream()
        try:
            for i, ids in enumerate(job.prompt_ids):
                await self.async_engine.add_request(stream, f"{job.response_id}-{i}", ids, job.params,
                                                    group_id=job.response_id)
            if job.stream:
                return await self._stream_response(request, job, stream)
            return await self._whole_response(job, stream)
        except ValueError as exc:  # the engine rejected a prompt; a ParamError names its field
            raise ProtocolError(str(exc), param=getattr(exc, "param", None) or job.prompt_param) from None
        except EngineDeadError as exc:
            raise ProtocolError(f"The engine cannot serve: {exc}", status=503, type="server_error",
                                code="engine_dead") from None
        except EngineError as exc:
            raise ProtocolError(str(exc), status=500, type="server_error") from None
        finally:
            stream.abort_unfinished()

    def _failure(self, error: str) -> EngineError:
        """The exception for a sequence the engine failed: EngineDeadError if the engine died."""
        dead = self.async_engine.dead_reason
        if dead is not None:
            return EngineDeadError(f"the engine is dead: {dead} (this request: {error})")
        return EngineError(f"engine error: {error}")

    def _choice_index(self, job: Job, stream: RequestStream, request_id: str, sample_index: int) -> int:
        return stream.request_ids.index(request_id) * job.params.n + sample_index

    async def _whole_response(self, job: Job, stream: RequestStream) -> web.Response:
        finals = {}
        while not stream.done:
            for request_id, output in (await stream.next_outputs()).items():
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

    async def _stream_response(self, request: web.Request, job: Job, stream: RequestStream) -> web.StreamResponse:
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

    def _chunk_choice(self, job: Job, index: int, cursor: ChoiceCursor, delta) -> dict:
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
        runner = self.make_runner()
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        print("jaxserve: stopped", flush=True)


def run_server(engine, config: ServerConfig) -> None:
    """Blocks serving `engine` until SIGTERM/SIGINT; returns after a clean shutdown."""
    asyncio.run(OpenAIServer(engine, config).serve())
