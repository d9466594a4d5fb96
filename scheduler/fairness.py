"""Fairness between client requests: running seats counted per group, with a cap.

A group is one client request's prompts and n samples (`Request.group_id`). While requests of
another group wait, a group holds at most `cap` running seats: the scheduler admits the first
waiting request whose group is under its cap (passing over capped ones), and when no seat or block
is free it preempts the newest running request of the group furthest over its cap. With nobody
else waiting, one group may fill the batch (work-conserving).
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.request import Request


class GroupSeats:
    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._seats: dict[str, int] = {}

    def join(self, request: Request) -> None:
        self._seats[request.group_id] = self._seats.get(request.group_id, 0) + 1

    def leave(self, request: Request) -> None:
        left = self._seats[request.group_id] - 1
        if left:
            self._seats[request.group_id] = left
        else:
            del self._seats[request.group_id]

    def under_cap(self, request: Request) -> bool:
        return self.cap is None or self._seats.get(request.group_id, 0) < self.cap

    def pick(self, head: Request, waiting: Iterable[Request]) -> Request:
        """The head of the queue, unless its group is capped and another group's request is not
        (then the first such one in queue order). O(waiting) only in that case."""
        if self.under_cap(head):
            return head
        return next((r for r in waiting if self.under_cap(r)), head)

    def victim_for(self, request: Request, running: dict[str, Request]) -> Request | None:
        """The newest running request of the group furthest over its cap, if `request`'s own
        group is under its cap; None otherwise."""
        if self.cap is None or not self.under_cap(request) or not self._seats:
            return None
        biggest = max(self._seats, key=self._seats.__getitem__)
        if self._seats[biggest] <= self.cap:
            return None
        return next(r for r in reversed(running.values()) if r.group_id == biggest)
