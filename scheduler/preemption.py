"""Preemption by recompute, the part of Scheduler (scheduler.py) that takes a running request's
seat and blocks back: the victim (the newest running request, or under policy "priority" the
lowest priority one; a group over its fairness cap, fairness.py), its blocks freed (full ones
hashed first, so its resume finds them in the prefix cache), its progress reset to 0, and it goes
back to the front of the waiting queue, out of this step's plan."""

from __future__ import annotations

from scheduler.budget import StepPlan
from scheduler.request import Request, RequestStatus


class SchedulerPreemption:
    """Scheduler's preemption (a mixin: it uses Scheduler's config, running, waiting,
    group_seats, lora_seats, kv_cache_manager and num_preemptions)."""

    # -- preemption --------------------------------------------------------------------------

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running.values(), key=lambda r: (r.priority, r.arrival_time))
        return next(reversed(self.running.values()))

    def _make_room(self, request: Request, plan: StepPlan) -> bool:
        """Preempts one running request for `request`: a lower-priority one (policy "priority"),
        or the newest of a group over its fairness cap (fairness.py). False if none qualifies."""
        if self._preempt_for(request, plan):
            return True
        victim = self.group_seats.victim_for(request, self.running)
        if victim is not None:
            self._preempt(victim, plan)
        return victim is not None

    def _preempt_for(self, request: Request, plan: StepPlan) -> bool:
        """Priority policy: preempt the lowest-priority running request if `request` outranks it."""
        if self.config.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        del self.running[victim.req_id]
        self.group_seats.leave(victim)
        self.lora_seats.leave(victim)
        self.kv_cache_manager.free(victim)
        # Hash every full block now, so the resumed request finds its cached prefix.
        self.kv_cache_manager.update_block_hashes(victim)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(victim)
        unscheduled = plan.scheduled.pop(victim.req_id, None)
        if unscheduled is not None:
            plan.budget += unscheduled.num_scheduled_tokens
            plan.logits += unscheduled.num_logits
        plan.preempted[victim.req_id] = None
