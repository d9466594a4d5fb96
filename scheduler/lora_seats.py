"""LoRA adapters among the running requests: at most `max_loras` distinct ones at once.

The runner has max_loras device slots (engine/lora/slots.py); a slot held by a running request
cannot be evicted, so a waiting request whose adapter (`Request.lora_id`, 0 = none) is not among
the running ones may only be admitted while fewer than max_loras adapters run. Otherwise it waits,
and the scheduler admits the requests behind it that can run (it never blocks the queue).
"""

from __future__ import annotations

from scheduler.request import Request


class LoRASeats:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras  # 0: adapters are off (every request has lora_id 0)
        self._running: dict[int, int] = {}  # lora_id -> running requests using it

    @property
    def active(self) -> dict[int, int]:
        return dict(self._running)

    def can_run(self, request: Request) -> bool:
        lora_id = request.lora_id
        return not lora_id or lora_id in self._running or len(self._running) < self.max_loras

    def join(self, request: Request) -> None:
        if request.lora_id:
            self._running[request.lora_id] = self._running.get(request.lora_id, 0) + 1

    def leave(self, request: Request) -> None:
        if request.lora_id:
            left = self._running[request.lora_id] - 1
            if left:
                self._running[request.lora_id] = left
            else:
                del self._running[request.lora_id]
