"""AsyncLLMEngine: drives a synchronous, single-threaded LLMEngine from asyncio.

The engine is not thread-safe, so exactly one background thread (the step thread) calls its
methods. What happens:

1. A handler on the event loop validates its input, then `await add_request(...)`: the command goes
   on a thread-safe queue together with a concurrent Future and the handler's `RequestStream`.
2. The step thread blocks on that queue while the engine is idle (after warming, one step at a
   time between looks at the queue, any compiled bucket that has not run yet: the ones compiled in
   the background; LLMEngine.warm_up_next). Otherwise, before each step, it
   drains every queued command (add, abort, stop), calls `add_request` / `abort_request`, and
   resolves the add's Future (a ValueError from the engine reaches the handler as a 400).
3. It refreshes the stats snapshot (read by /metrics and the overload check; never the engine
   itself) and, while there is work, runs one `step()`.
4. The step's outputs go to the event loop in one `call_soon_threadsafe` per step, which records
   latency metrics and puts each output on its request's stream, so every token reaches its HTTP
   response as soon as it is sampled.
5. If `step()` raises, the requests in flight get the error (their handlers answer 500 or end the
   stream with an error event) and are aborted in the engine; the server keeps serving. (The
   LLMEngine itself fails only a failed step's requests, through `CompletionOutput.error`.)
6. If the engine reports itself dead (`engine.dead_reason`, a runner that lost its device state),
   every request in flight fails with that reason, later adds are refused with `EngineDeadError`
   and `dead_reason` is set here, so the server's /health and new requests answer 503.

Admission counts sequences, not prompts: a request with n samples is n sequences in the engine's
waiting queue, so `queue_is_full` and the pending count are in sequences. Each add carries a
`group_id` (one per HTTP request) for the engine's fairness cap.

What crosses between the two threads (the commands, `RequestStream`, `EngineError` and
`EngineDeadError`) is in request_stream.py; the public names are importable from here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

from engine.frontends.request_stream import (
    AbortCommand,
    AddCommand,
    EngineDeadError,
    EngineError,
    RequestStream,
    StopCommand,
)
from engine.metrics import ServerMetrics
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARM_UP_POLL_S = 0.5  # while buckets compile in the background, an idle step thread looks this often for one to warm


@dataclasses.dataclass
class _Tracker:
    """Per engine request, on the event loop: where outputs go and what latency metrics need."""

    stream: RequestStream
    arrival: float
    num_tokens: int = 0
    last_token_time: float | None = None


class AsyncLLMEngine:
    """Owns the step thread. Every public method must be called from the event loop thread."""

    def __init__(self, engine, *, max_queue_len: int | None = None, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _num_pending and _stats together
        self._num_pending = 0  # sequences of adds queued but not yet handed to the engine
        self._dead_reason: str | None = None  # set once by the step thread, read anywhere
        self._stats = None  # newest EngineStats from the step thread
        self._trackers: dict[str, _Tracker] = {}  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Fails the requests still in flight, stops the step thread and waits for it."""
        self._stopping = True
        for request_id in list(self._trackers):
            self._fail(request_id, EngineError(reason))
        self._commands.put(StopCommand())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can serve no more; None while it can (or before start)."""
        if self._dead_reason is not None:
            return self._dead_reason
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return "the engine step thread ended"
        return None

    # ---- the event-loop side ---------------------------------------------------------------

    def new_stream(self) -> RequestStream:
        return RequestStream(self)

    def stats(self):
        with self._lock:
            return self._stats

    def num_pending(self) -> int:
        """Sequences queued for the engine but not yet handed to it."""
        with self._lock:
            return self._num_pending

    def queue_is_full(self, num_new_seqs: int) -> bool:
        """True when `num_new_seqs` more sequences would exceed max_queue_len waiting sequences
        (the engine's waiting queue, which holds each of a request's n samples, plus pending)."""
        if self.max_queue_len is None:
            return False
        with self._lock:
            waiting = (self._stats.num_waiting if self._stats is not None else 0) + self._num_pending
        return waiting + num_new_seqs > self.max_queue_len

    @property
    def num_in_flight(self) -> int:
        return len(self._trackers)

    async def add_request(self, stream: RequestStream, request_id: str, prompt: str | list[int],
                          params: SamplingParams, *, group_id: str | None = None, grammar=None,
                          lora_request=None) -> None:
        """Hands one request to the engine; its outputs go to `stream`. `group_id` ties the
        prompts of one client request together (the engine's fairness cap); `grammar` is its
        structured output grammar, compiled on the caller's thread. Raises the engine's
        ValueError for a bad request, EngineDeadError when the engine cannot serve, EngineError
        when the step thread is gone."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.is_alive:
            raise EngineError("the engine is not running")
        arrival = time.monotonic()
        future: concurrent.futures.Future = concurrent.futures.Future()
        stream.request_ids.append(request_id)
        self._trackers[request_id] = _Tracker(stream=stream, arrival=arrival)
        with self._lock:
            self._num_pending += params.n
        self._commands.put(AddCommand(request_id, prompt, params, arrival, future, group_id, grammar, lora_request))
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            # Rejected by the engine, or the handler was cancelled while waiting (then the add may
            # still land: the abort queued behind it removes it).
            stream.finished.add(request_id)
            self._trackers.pop(request_id, None)
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Queues an abort; the step thread frees the request's blocks before its next step."""
        self._trackers.pop(request_id, None)
        self._commands.put(AbortCommand(request_id))

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """Event loop: record latencies and route each output to its stream."""
        for output in outputs:
            tracker = self._trackers.get(output.request_id)
            if tracker is None:  # aborted meanwhile
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - tracker.num_tokens
            if new_tokens > 0:
                if tracker.last_token_time is None:
                    self.metrics.observe_first_token(now - tracker.arrival)
                    new_tokens -= 1
                if new_tokens > 0:
                    self.metrics.observe_inter_token(now - (tracker.last_token_time or now), new_tokens)
                tracker.num_tokens = num_tokens
                tracker.last_token_time = now
            if output.finished:
                del self._trackers[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else None
                self.metrics.observe_finished(now - tracker.arrival, reason or "stop")
            tracker.stream._put(output)

    def _fail(self, request_id: str, error: EngineError) -> None:
        tracker = self._trackers.pop(request_id, None)
        if tracker is not None:
            tracker.stream._put(error)
            self._commands.put(AbortCommand(request_id))

    def _fail_all(self, request_ids: list[str], message: str, dead: bool = False) -> None:
        if not dead:
            self.metrics.engine_step_errors += 1
        for request_id in request_ids:
            self._fail(request_id, EngineDeadError(message) if dead else EngineError(message))

    # ---- the step thread -------------------------------------------------------------------

    def _run(self) -> None:
        live: set[str] = set()  # request ids handed to the engine and not finished (this thread only)
        while True:
            try:
                if not self._run_once(live):
                    return
            except Exception:  # noqa: BLE001 - the step thread must outlive any one bad request
                logger.exception("engine loop error")
                self._check_dead(live)

    def _run_once(self, live: set[str]) -> bool:
        """Handles the queued commands, then runs one step if there is work. False on stop."""
        dead = self._dead_reason is not None
        busy = not dead and self.engine.has_unfinished_requests()
        # Idle: warm a bucket compiled in the background (one step, then look at the queue
        # again), or wait for work (while buckets still compile, WARM_UP_POLL_S at a time).
        if busy or (not dead and self._commands.empty() and self._warm_up_next()):
            commands = []
        else:
            try:
                commands = [self._commands.get(timeout=None if dead or not self._warm_up_pending() else WARM_UP_POLL_S)]
            except queue.Empty:
                commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        num_seqs = 0
        try:
            for position, command in enumerate(commands):
                if isinstance(command, StopCommand):
                    if not dead:
                        self._abort_in_engine(live)
                    self._refuse_queued_adds(commands[position + 1:], "the server is shutting down")
                    return False
                if isinstance(command, AddCommand):
                    num_seqs += command.num_seqs
                    if dead:
                        self._refuse(command, EngineDeadError(self._dead_reason))
                    else:
                        self._handle_add(command, live)
                elif isinstance(command, AbortCommand) and command.request_id in live and not dead:
                    self._abort_in_engine([command.request_id])
                    live.discard(command.request_id)
        finally:
            self._refresh_stats(num_seqs)
        if dead or not self.engine.has_unfinished_requests():
            live.clear()
            return True
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not end the server
            logger.exception("engine step failed; failing the %d requests in flight", len(live))
            if self._check_dead(live):
                return True
            failed = sorted(live)
            self._abort_in_engine(failed)
            live.clear()
            message = f"engine error: {type(exc).__name__}: {exc}"
            self._loop.call_soon_threadsafe(self._fail_all, failed, message)
            self._refresh_stats(0)
            return True
        for output in outputs:
            if output.finished:
                live.discard(output.request_id)
        self._refresh_stats(0)
        dying = self._dead_reason is None and getattr(self.engine, "dead_reason", None) is not None
        if dying:  # known before the failed outputs arrive, so their handlers can say why
            self._dead_reason = str(self.engine.dead_reason)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs, time.monotonic())
        if dying:
            self._fail_dead(live)
        return True

    def _warm_up_next(self) -> bool:
        warm = getattr(self.engine, "warm_up_next", None)
        return bool(warm and warm())

    def _warm_up_pending(self) -> bool:
        pending = getattr(self.engine, "warm_up_pending", None)
        return bool(pending and pending())

    def _check_dead(self, live: set[str]) -> bool:
        """If the engine says it is dead: remember why, fail everything in flight. True if dead."""
        reason = getattr(self.engine, "dead_reason", None)
        if reason is None or self._dead_reason is not None:
            return self._dead_reason is not None
        self._dead_reason = str(reason)
        self._fail_dead(live)
        return True

    def _fail_dead(self, live: set[str]) -> None:
        logger.error("the engine is dead: %s", self._dead_reason)
        failed = sorted(live)
        live.clear()
        self._loop.call_soon_threadsafe(self._fail_all, failed, f"the engine is dead: {self._dead_reason}", True)

    def _refuse(self, command: AddCommand, error: Exception) -> None:
        if command.future.set_running_or_notify_cancel():
            command.future.set_exception(error)

    def _refuse_queued_adds(self, commands: list, reason: str) -> None:
        """At stop: adds not handed to the engine fail, so no handler waits on them forever."""
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, AddCommand):
                self._refuse(command, EngineError(reason))

    def _abort_in_engine(self, request_ids) -> None:
        for request_id in list(request_ids):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request(%s) failed", request_id)

    def _handle_add(self, command: AddCommand, live: set[str]) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the handler gave up waiting (client gone)
        try:
            extra = {"grammar": command.grammar} if command.grammar is not None else {}
            if command.lora_request is not None:
                extra["lora_request"] = command.lora_request
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time, group_id=command.group_id, **extra)
        except Exception as exc:  # noqa: BLE001 - goes back to the handler
            if isinstance(exc, ValueError):
                command.future.set_exception(exc)
            elif getattr(self.engine, "dead_reason", None) is not None:
                command.future.set_exception(EngineDeadError(str(self.engine.dead_reason)))
            else:
                command.future.set_exception(EngineError(f"{type(exc).__name__}: {exc}"))
            return
        live.add(command.request_id)
        command.future.set_result(None)

    def _refresh_stats(self, num_seqs: int) -> None:
        """A new stats snapshot; `num_seqs` sequences just left the pending count."""
        try:
            stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001 - keep the last snapshot, but the pending count must move
            logger.exception("get_stats failed")
            stats = self._stats
        with self._lock:
            self._stats = stats
            self._num_pending -= num_seqs
