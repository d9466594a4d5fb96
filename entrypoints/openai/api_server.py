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
5. The answer (response_writers.py). Streaming: server-sent events, one chunk per choice whenever
   the engine produced new text, ending with `data: [DONE]`. Whole: wait for the last outputs,
   answer one JSON body. A sequence the engine failed (`CompletionOutput.error`) fails its HTTP
   request: 500, or an error event.
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

This module is the app: routes, middleware, reading bodies, handing prepared jobs to the engine,
draining on SIGTERM. The settings (`ServerConfig`, `default_body_limit`) are in
server_config.py and importable from here too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import signal
import time

from aiohttp import web

from engine.frontends.async_engine import AsyncLLMEngine, EngineDeadError, EngineError
from engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.metrics import ServerMetrics
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.http_guard import GuardedAppRunner
from entrypoints.openai.lora_routes import LoRARoutes, ModelNames
from entrypoints.openai.prepare import Job, Preparer, detokenize_body, tokenize_body, vocab_size_of
from entrypoints.openai.protocol import RequestLimits
from entrypoints.openai.response_writers import ResponseWriter
from entrypoints.openai.responses import TokenTexts
from entrypoints.openai.server_config import (
    BODY_BYTES_BASE,
    BODY_BYTES_PER_TOKEN,
    ServerConfig,
    default_body_limit,
)

logger = logging.getLogger(__name__)

# ServerConfig and the body limit live in server_config.py; serve.py and the tests import them here.
__all__ = ["BODY_BYTES_BASE", "BODY_BYTES_PER_TOKEN", "OpenAIServer", "ServerConfig",
           "default_body_limit", "run_server"]


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
        lora_manager = getattr(engine, "lora_manager", None)  # engine/lora/manager.py; None: no adapters
        self.served_names = ModelNames(tuple(dict.fromkeys((self.model_name, engine.model_name))), lora_manager)
        self.preparer = Preparer(
            tokenizer=engine.tokenizer, max_model_len=engine.max_model_len, vocab_size=vocab_size_of(engine),
            max_logprobs=getattr(getattr(engine, "config", None), "max_logprobs", None),
            served_names=self.served_names, model_name=self.model_name,
            limits=RequestLimits(max_prompts=config.max_prompts, max_n=config.max_n),
            max_queue_len=config.max_queue_len, trust_chat_special_tokens=config.trust_chat_special_tokens,
            grammar_compiler=getattr(engine, "compile_grammar", None))
        self.max_body_bytes = config.max_body_bytes or default_body_limit(self.max_model_len)
        self.metrics = ServerMetrics()
        self.async_engine = AsyncLLMEngine(engine, max_queue_len=config.max_queue_len, metrics=self.metrics)
        self.token_texts = TokenTexts(self.tokenizer)
        self.writer = ResponseWriter(self.async_engine, self.token_texts)
        self.created = int(time.time())
        self.draining = False
        self.num_in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(config.num_prepare_threads, thread_name_prefix="prepare")
        self.lora = LoRARoutes(lora_manager, self.served_names, self._pool, parent=self.model_name)

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        self.lora.add_routes(app)
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
        # Degraded (a disaggregated engine whose decode pool is lost decodes in its prefill pool):
        # it still serves, so 200, as probes and load balancers count only 2xx as up (a 503 would
        # take a working server out of rotation or restart it); the body and the
        # jaxserve:engine_degraded gauge say so, for alerts.
        degraded = getattr(self.async_engine.stats(), "degraded_reason", None)
        if degraded is not None:
            return web.json_response({"status": "degraded", "reason": degraded})
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.async_engine.stats(), num_pending=self.async_engine.num_pending())
        return web.Response(body=text.encode("utf-8"), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "max_model_len": self.max_model_len} for name in self.served_names.base]
        data += self.lora.model_cards(self.created, self.max_model_len)
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

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._prepare(lambda raw: tokenize_body(self.preparer, raw), await self._read_body(request))
        return web.json_response(body)

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._prepare(lambda raw: detokenize_body(self.preparer, raw), await self._read_body(request))
        return web.json_response(body)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        job = await self._prepare(self.preparer.chat, await self._read_body(request))
        return await self._generate(request, job)

    async def _generate(self, request: web.Request, job: Job) -> web.StreamResponse:
        if self.async_engine.queue_is_full(job.num_seqs):
            raise ProtocolError("The server is overloaded (the waiting queue is full); retry later",
                                status=503, type="server_error", code="queue_full", headers={"Retry-After": "1"})
        adapter = await self.lora.adapter_for(job.model)  # model=<LoRA adapter name>
        stream = self.async_engine.new_stream()
        try:
            for i, ids in enumerate(job.prompt_ids):
                await self.async_engine.add_request(stream, f"{job.response_id}-{i}", ids, job.params,
                                                    group_id=job.response_id, grammar=job.grammar,
                                                    lora_request=adapter)
            if job.stream:
                return await self.writer.stream_response(request, job, stream)
            return await self.writer.whole_response(job, stream)
        except ValueError as exc:  # the engine rejected a prompt; a ParamError names its field
            raise ProtocolError(str(exc), param=getattr(exc, "param", None) or job.prompt_param) from None
        except EngineDeadError as exc:
            raise ProtocolError(f"The engine cannot serve: {exc}", status=503, type="server_error",
                                code="engine_dead") from None
        except EngineError as exc:
            raise ProtocolError(str(exc), status=500, type="server_error") from None
        finally:
            stream.abort_unfinished()

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
