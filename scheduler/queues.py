"""Waiting queues: arrival order (fcfs, static) or (priority, arrival) order (priority)."""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterator

from scheduler.request import Request


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: collections.deque[Request] = collections.deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        # O(len): only aborts of waiting requests come here.
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest priority value first, then earliest arrival; a preempted request wins ties."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)

    def push(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._back), request)
        )

    def push_front(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._front), request)
        )

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # O(len): only aborts of waiting requests come here.
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
