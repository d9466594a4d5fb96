"""Connection-level guards for the aiohttp server: a request-head read timeout, and parser errors
in OpenAI's JSON format.

aiohttp (3.14) has no header-read timeout of its own. Its keepalive timer also closes a connection
that never completes a request head, but it is one knob for two jobs (idle keep-alive and slow
heads), is not counted, and does not restart per request. So the server swaps in
`GuardedRequestHandler` per connection (through `GuardedAppRunner`):

1. From the connection's start, and from the first byte of each later request, the request head
   (request line and headers) must be complete within `header_timeout_s`; otherwise the connection
   is closed and `on_slow("headers")` counts it. A slow-loris client that trickles one header byte
   at a time is dropped at the deadline, however steadily it sends.
2. The body is read by the route under its own deadline (api_server's `body_timeout_s`, phase
   "body"); an idle keep-alive connection is closed after aiohttp's `keepalive_timeout`.
3. Requests aiohttp's parser refuses (a bad request line, a smuggling attempt such as both
   Content-Length and Transfer-Encoding, bare CR or LF, NUL bytes, too many headers, a URL over
   max_line_size) get `{"error": {...}}` JSON with their 4xx status instead of text/plain.

This leans on two aiohttp internals, pinned by tests/entrypoints/test_server_hostile.py:
`RequestHandler._request_count` (complete request heads parsed) and `AppRunner._make_server`.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, plus the head timeout and JSON parser errors."""

    def __init__(self, manager, *, header_timeout_s: float | None, on_slow: Callable[[str], None],
                 on_error_status: Callable[[int], None], **kwargs):
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._on_slow = on_slow
        self._on_error_status = on_error_status
        self._header_handle: asyncio.TimerHandle | None = None
        self._heads_at_arm = 0  # complete heads parsed when the timer was armed
        self._in_request = False  # a head is complete and its response not yet finished

    def _arm(self) -> None:
        if self._header_timeout_s and self._header_handle is None:
            self._heads_at_arm = self._request_count
            self._header_handle = self._loop.call_later(self._header_timeout_s, self._header_timed_out)

    def _disarm(self) -> None:
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None

    def _header_timed_out(self) -> None:
        self._header_handle = None
        if self.transport is None or self._request_count > self._heads_at_arm:
            return  # closed already, or the head arrived in time
        self._on_slow("headers")
        self.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if data and not self._in_request:
            self._arm()  # the first byte of a new request head starts its clock
        before = self._request_count
        super().data_received(data)
        if self._request_count > before:
            self._in_request = True
            self._disarm()

    async def finish_response(self, request, resp, start_time):
        result = await super().finish_response(request, resp, start_time)
        self._in_request = False
        return result

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Like aiohttp's, but the body is OpenAI's error JSON."""
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text, kind, code = "Internal server error", "server_error", None
        else:
            logger.debug("bad HTTP request from %s: %s", request.remote, message or exc)
            detail = message or getattr(exc, "message", None) or str(exc or "") or http.HTTPStatus(status).phrase
            text, kind, code = f"Bad HTTP request: {str(detail)[:300]}", "invalid_request_error", "bad_http_request"
        self._on_error_status(status)
        body = {"error": {"message": text, "type": kind, "param": None, "code": code}}
        response = web.json_response(body, status=status)
        response.force_close()
        return response


class _GuardedServer(web.Server):
    """aiohttp's connection factory, making GuardedRequestHandlers."""

    _guard: dict

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._guard, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose connections are GuardedRequestHandlers."""

    def __init__(self, app: web.Application, *, header_timeout_s: float | None,
                 on_slow: Callable[[str], None], on_error_status: Callable[[int], None], **kwargs):
        super().__init__(app, **kwargs)
        self._guard_kwargs = dict(header_timeout_s=header_timeout_s, on_slow=on_slow,
                                  on_error_status=on_error_status)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # same object, our __call__
        server._guard = self._guard_kwargs
        return server
