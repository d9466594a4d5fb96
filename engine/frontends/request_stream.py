"""What passes between the event loop and AsyncLLMEngine's step thread (async_engine.py, beside it).

- In, on the engine's thread-safe command queue: `AddCommand` (a request, with the concurrent
  Future its handler awaits), `AbortCommand` and `StopCommand`. The step thread blocks on the
  queue while the engine is idle and drains it before each step.
- Out, per HTTP request: a `RequestStream` on the event loop, which the engine feeds each step's
  outputs (or an EngineError) through `call_soon_threadsafe`. Outputs are cumulative, so it keeps
  only the newest per engine request until the handler reads it.
- The errors a handler may see: `EngineError` (a failed step, the engine not running or
  shutting down) and `EngineDeadError` (the engine can serve no more).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class Aborter(Protocol):
    """What a stream needs of its engine (AsyncLLMEngine): aborting one engine request. A protocol,
    so that this module does not import async_engine.py, which imports it."""

    def abort(self, request_id: str) -> None: ...


class EngineError(RuntimeError):
    """The engine failed (or is shutting down) while this request was in flight."""


class EngineDeadError(EngineError):
    """The engine can serve no more (its runner lost its device state, or the step thread ended)."""


@dataclasses.dataclass
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    future: concurrent.futures.Future
    group_id: str | None = None
    grammar: object = None  # a CompiledGrammar built on the caller's thread (structured output)
    lora_request: object = None  # the LoRA adapter (a LoadedAdapter resolved on the caller's thread)

    @property
    def num_seqs(self) -> int:
        return self.params.n


@dataclasses.dataclass
class AbortCommand:
    request_id: str


class StopCommand:
    pass


class RequestStream:
    """The outputs of the engine requests of one HTTP request (one per prompt).

    Outputs are cumulative, so only the newest output of each request is kept until the reader
    takes it: a slow reader costs one output per request, not a backlog.
    """

    def __init__(self, engine: Aborter):
        self._engine = engine
        self._newest: dict[str, RequestOutput] = {}
        self._error: EngineError | None = None
        self._ready = asyncio.Event()
        self.request_ids: list[str] = []
        self.finished: set[str] = set()

    def _put(self, item: RequestOutput | EngineError) -> None:
        if isinstance(item, EngineError):
            self._error = item
        else:
            self._newest[item.request_id] = item
        self._ready.set()

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    async def next_outputs(self) -> dict[str, RequestOutput]:
        """Waits for news; returns the newest output per request id. Raises EngineError."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        newest, self._newest = self._newest, {}
        for request_id, output in newest.items():
            if output.finished:
                self.finished.add(request_id)
        return newest

    def abort_unfinished(self) -> None:
        """Aborts every request of this stream that has not finished (client gone, error, ...)."""
        for request_id in self.request_ids:
            if request_id not in self.finished:
                self.finished.add(request_id)
                self._engine.abort(request_id)
