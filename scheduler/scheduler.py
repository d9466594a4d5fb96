"""Scheduler: who runs at each token step, with how many tokens, and which KV blocks they own.

One step, in order (DESIGN.md sections 2-3):
 1. `schedule()` starts from the token budget, max_num_batched_tokens. Under policy "static", if
    nothing runs, it first admits a whole batch (up to max_num_seqs requests whose prompts fit in
    the pool); otherwise nobody new joins until that batch has finished.
 2. Running requests that decode (one uncomputed token) are scheduled first, in admission order.
    A decode whose last block is full gets a new block; if the pool is short, the newest running
    request (the lowest priority one under "priority") is preempted by recompute: its blocks are
    freed (full ones stay in the prefix cache), its progress resets to 0, and it goes back to the
    front of the waiting queue. A request preempted in this step is never scheduled in it.
    A decode carrying draft tokens (`Request.spec_token_ids`, speculative decoding) feeds its last
    token plus the drafts and samples at all of them (num_logits = 1 + drafts); drafts only take
    the budget left after every decode row's own token, and never pass max_tokens/max_model_len.
 3. Running requests still in their prompt (chunked prefill) take what the budget leaves.
 4. Waiting requests are admitted in queue order (fcfs: arrival; priority: lower value first) while
    the budget, max_num_seqs and the pool allow, unless step 2 had to preempt. Each starts at its
    prefix-cache hit (full blocks inside its first num_tokens - 1 tokens). A prompt larger than the
    budget takes what is left with chunked prefill, and otherwise waits (and so does everyone
    behind it). Under "priority", a waiting request may preempt a running one of lower priority.
    Fairness: a request whose group already holds max_seqs_per_group running seats is passed
    over while a request of another group waits (the first such one in queue order is admitted),
    and when no seat or block is free, the newest request of a group over its cap is preempted.
 5. The `SchedulerOutput` lists each scheduled request's tokens, position and whole block table
    (and its sliding layers' table, with sliding-window accounting), plus the ids finished,
    aborted and preempted since the last step.
 6. The engine runs the step and calls `update(output, step_result)`: computed counts advance,
    sampled tokens are appended, finishes are decided (EOS unless ignored, stop token, max_tokens,
    max_model_len), newly full blocks enter the prefix cache, the sliding layers' blocks their
    window has passed are freed (scheduler/sliding_window.py), and finished requests free blocks.

schedule() costs O(running + admitted) and update() O(scheduled); under "priority" each preemption
adds an O(running) scan for the victim.
"""

from __future__ import annotations

from scheduler.budget import StepPlan, clamp_drafts, fit_logits
from scheduler.config import SchedulerConfig
from scheduler.fairness import GroupSeats
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.lora_seats import LoRASeats
from scheduler.outputs import NewRequestData, ScheduledRequest, SchedulerOutput, StepResult
from scheduler.preemption import SchedulerPreemption
from scheduler.queues import FCFSQueue, PriorityQueue
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.results import append_tokens, check_step_result
from scheduler.stats import SchedulerObservability

RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerObservability, SchedulerPreemption):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(config)
        self.waiting = PriorityQueue() if config.policy == "priority" else FCFSQueue()
        # Admitted requests in admission order (a dict: O(1) removal, newest is the last key).
        self.running: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # live: waiting or running
        self.group_seats = GroupSeats(config.max_seqs_per_group)  # fairness (fairness.py)
        self.lora_seats = LoRASeats(config.max_loras)  # distinct adapters running (lora_seats.py)
        self.num_preemptions = 0
        self.admissions_held = False  # True: schedule() admits nothing (running requests go on)
        self._num_steps = 0
        self._finished_req_ids: list[str] = []
        self._aborted_req_ids: list[str] = []
        # Requests scheduled by the latest schedule() that still await update().
        self._pending: dict[str, Request] | None = None

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"add_request takes a Request, got {type(request).__name__}")
        rid, num_prompt = request.req_id, request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if num_prompt >= self.config.max_model_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {num_prompt} tokens, max_model_len is "
                f"{self.config.max_model_len}; a prompt must be shorter, to leave room for output"
            )
        if rid in self.requests:
            raise ValueError(f"request {rid!r}: a live request already has this req_id")
        if request.lora_id and not self.config.max_loras:
            raise ValueError(f"request {rid!r}: it has a LoRA adapter (lora_id {request.lora_id}), "
                             "but SchedulerConfig.max_loras is 0 (adapters off)")
        if request.lora_id and self.config.policy == "static":
            raise ValueError(f"request {rid!r}: LoRA adapters do not run under policy 'static'")
        # Output tokens are allowed before the first admission: a request whose prompt ran in
        # another engine (prefill/decode disaggregation) starts with its first token.
        if request.status is not RequestStatus.WAITING or request._admitted or request.num_computed_tokens:
            raise ValueError(f"request {rid!r}: already used; build a new Request")
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[rid] = request
        self.waiting.push(request)

    def abort_request(self, req_id: str) -> bool:
        """Cancel a live request and free its blocks now; False if unknown or finished."""
        return self._finish(req_id, RequestStatus.ABORTED, FinishReason.ABORT)

    def finish_request(self, req_id: str, reason: FinishReason | str) -> bool:
        """Finish a live request for a reason the engine decided (e.g. a stop string)."""
        reason = FinishReason(reason)
        status = RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED
        return self._finish(req_id, status, reason)

    def _finish(self, req_id: str, status: RequestStatus, reason: FinishReason) -> bool:
        request = self.requests.pop(req_id, None)
        if request is None:
            return False
        if request.status is RUNNING:
            del self.running[req_id]
            self.group_seats.leave(request)
            self.lora_seats.leave(request)
            self.kv_cache_manager.free(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finish_reason = reason
        ids = self._aborted_req_ids if status is RequestStatus.ABORTED else self._finished_req_ids
        ids.append(req_id)
        return True

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._pending:
            raise RuntimeError(
                "Scheduler.schedule() called again before update(): pass the previous "
                "SchedulerOutput and its StepResult to update() first"
            )
        config = self.config
        plan = StepPlan(config.max_num_batched_tokens, config.max_num_logits or config.max_num_batched_tokens)
        if config.policy == "static" and not self.running:
            self._admit_static_batch(plan)

        # Steps 2-3: decodes, then unfinished prefills; a snapshot, as preemption edits `running`.
        prefilling: list[Request] = []
        decoding: list[Request] = []
        num_drafts = 0
        for request in self.running.values():
            # num_tokens - num_computed_tokens, spelled out: this loop is the hot path.
            num_new = (
                len(request.prompt_token_ids)
                + len(request.output_token_ids)
                - request.num_computed_tokens
            )
            if num_new == 1:
                decoding.append(request)
                num_drafts += len(request.spec_token_ids)
            else:
                prefilling.append(request)
                request.spec_token_ids = []
        # Drafts only take budget every decode row's own token leaves.
        spare = plan.budget - len(decoding) if num_drafts else 0
        for request in decoding:
            if request.status is not RUNNING:
                continue  # preempted earlier in this loop
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                drafts = clamp_drafts(request, drafts, spare, self.config.max_model_len)
                spare -= len(drafts)
            if plan.budget >= 1 + len(drafts):
                self._schedule_running(request, 1 + len(drafts), plan, drafts)
        for i, request in enumerate(prefilling):
            if plan.budget == 0:
                break
            if request.status is not RUNNING:
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > plan.budget:
                if not config.enable_chunked_prefill:
                    continue
                num_new = plan.budget
            # A scored prompt leaves a logit row for every row that may still join this step.
            reserve = len(prefilling) - i - 1 + min(len(self.waiting), config.max_num_seqs - len(self.running))
            num_new = fit_logits(request, num_new, request.num_tokens - request.num_computed_tokens,
                                 plan.logits, reserve)
            if num_new:
                self._schedule_running(request, num_new, plan)

        # Step 4: admissions (none after a preemption: the pool is short already; none while an
        # owner holds them, e.g. a decode pool whose imported blocks have not landed yet).
        if config.policy != "static" and not plan.preempted and not self.admissions_held:
            self._admit_waiting(plan)

        self._num_steps += 1
        output = SchedulerOutput(
            step_id=self._num_steps,
            scheduled=list(plan.scheduled.values()),
            num_batched_tokens=config.max_num_batched_tokens - plan.budget,
            finished_req_ids=self._finished_req_ids,
            aborted_req_ids=self._aborted_req_ids,
            preempted_req_ids=list(plan.preempted),
            new_requests=[
                NewRequestData(r.req_id, r.prompt_token_ids, list(r.output_token_ids), r.sampling)
                for r in plan.admitted
                if r.status is RUNNING  # a static-batch member may be preempted before it runs
            ],
        )
        self._finished_req_ids, self._aborted_req_ids = [], []
        self._pending = {rid: self.running[rid] for rid in plan.scheduled}
        return output

    def _schedule_running(self, request: Request, num_new: int, plan: StepPlan,
                          drafts: list[int] | None = None) -> None:
        """Allocate for and schedule a running request, preempting others while blocks are short.
        A decode with drafts allocates slots for them too (rejected ones are reused next step)."""
        while True:
            if self.kv_cache_manager.allocate_slots(request, num_new) is not None:
                self._add_to_plan(request, num_new, plan, drafts)
                return
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return

    def _admit_waiting(self, plan: StepPlan) -> None:
        config, kv = self.config, self.kv_cache_manager
        block_size = config.block_size
        while self.waiting and plan.budget > 0:
            request = self.group_seats.pick(self.waiting.peek(), self.waiting)
            if not self.lora_seats.can_run(request):
                # Its adapter needs a device slot and every one is held by running requests: it
                # waits, the first request behind it that can run goes (nobody is blocked).
                runnable = [r for r in self.waiting if self.lora_seats.can_run(r)]
                if not runnable:
                    return
                request = next((r for r in runnable if self.group_seats.under_cap(r)), runnable[0])
            if request.req_id in plan.preempted:
                return  # preempted in this step: it must not be scheduled in it
            # takes no references yet; a prompt to score is computed whole
            computed = [] if request.prompt_logprobs else kv.get_computed_blocks(request)
            num_computed = len(computed) * block_size
            num_new = request.num_tokens - num_computed
            if num_new > plan.budget:
                if not config.enable_chunked_prefill:
                    return  # the prompt waits for a step with room, and so does the queue
                num_new = plan.budget
            if len(self.running) >= config.max_num_seqs and not self._make_room(request, plan):
                return
            reserve = min(len(self.waiting), config.max_num_seqs - len(self.running)) - 1
            num_new = fit_logits(request, num_new, request.num_tokens - num_computed, plan.logits, reserve)
            if not num_new:
                return
            if kv.allocate_slots(request, num_new, computed) is None:
                if self._make_room(request, plan):
                    continue  # blocks were freed; look the prefix up again
                return
            if request is self.waiting.peek():
                self.waiting.pop()
            else:
                self.waiting.remove(request)  # passed over a capped group's request
            self._start_running(request, num_computed)
            plan.admitted.append(request)
            self._add_to_plan(request, num_new, plan)

    def _admit_static_batch(self, plan: StepPlan) -> None:
        """Static baseline: admit up to max_num_seqs waiting requests whose prompts fit now."""
        kv = self.kv_cache_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed = kv.get_computed_blocks(request)
            num_computed = len(computed) * self.config.block_size
            if kv.allocate_slots(request, request.num_tokens - num_computed, computed) is None:
                return
            self.waiting.pop()
            self._start_running(request, num_computed)
            plan.admitted.append(request)

    def _start_running(self, request: Request, num_computed: int) -> None:
        request.num_computed_tokens = num_computed
        request.status = RUNNING
        self.group_seats.join(request)
        self.lora_seats.join(request)
        if not request._admitted:
            request._admitted = True
            request.num_cached_tokens = num_computed
        self.running[request.req_id] = request

    def _add_to_plan(self, request: Request, num_new: int, plan: StepPlan,
                     drafts: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        req_id = request.req_id
        num_prompt_logits = 0
        if drafts:  # a decode verifying drafts: its last token, then the drafts, all sampled
            token_ids, num_logits = request.token_slice(start, start + 1) + drafts, 1 + len(drafts)
        else:  # sample once the chunk reaches the last known token
            token_ids = request.token_slice(start, end)
            reaches_end = end == len(request.prompt_token_ids) + len(request.output_token_ids)
            num_logits = int(reaches_end)
            if request.prompt_logprobs:  # every position scores the next prompt token, or samples
                num_logits, num_prompt_logits = num_new, num_new - int(reaches_end)
        plan.logits -= num_logits
        sliding = self.kv_cache_manager.sliding
        plan.scheduled[req_id] = ScheduledRequest(  # positional: this runs once per request
            req_id,  # req_id
            token_ids,  # token_ids
            start,  # num_computed_tokens
            num_new,  # num_scheduled_tokens
            self.kv_cache_manager.block_tables[req_id],  # block_ids: the live table, no copy
            num_logits,  # num_logits
            num_prompt_logits,  # num_prompt_logits
            None if sliding is None else sliding.block_tables[req_id],  # sliding_block_ids
        )
        plan.budget -= num_new

    # -- update ------------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, step_result: StepResult) -> list[Request]:
        """Apply one step's results; returns the requests that finished in it (finish_reason set).

        Each sampling row appends its tokens in order and stops at the first that finishes the
        request (EOS, stop token, max_tokens, max_model_len); the rest are dropped. Rejected draft
        positions (`num_rejected_tokens`) roll `num_computed_tokens` back, so they run again."""
        pending = self._pending
        if pending is None or scheduler_output.step_id != self._num_steps:
            raise ValueError(
                "Scheduler.update() takes the SchedulerOutput of the latest schedule(), once "
                f"(got step {scheduler_output.step_id}, latest is {self._num_steps})"
            )
        sampled, rejected = check_step_result(scheduler_output, step_result, pending)
        self._pending = None
        kv = self.kv_cache_manager
        sliding = kv.sliding is not None
        max_model_len = self.config.max_model_len
        finished: list[Request] = []
        for sr in scheduler_output.scheduled:
            request = pending[sr.req_id]
            if request.status is not RUNNING:
                continue  # aborted or finished by the engine between schedule() and update()
            reason = None
            if sr.num_logits > sr.num_prompt_logits:
                num_back = rejected.get(sr.req_id, 0) if rejected else 0
                request.num_computed_tokens += sr.num_scheduled_tokens - num_back
                reason = append_tokens(request, sampled[sr.req_id], max_model_len)
            else:
                request.num_computed_tokens += sr.num_scheduled_tokens
            if request.prompt_logprobs and request.num_computed_tokens >= len(request.prompt_token_ids):
                request.prompt_logprobs = False  # scored; a resume may use the prefix cache
            # Cache before freeing, so a finished request's full blocks stay reusable.
            kv.cache_full_blocks(request)
            if sliding:  # sliding-window accounting: blocks no later query reads go back
                kv.release_out_of_window(request)
            if reason is not None:
                self._finish(sr.req_id, RequestStatus.FINISHED, reason)
                finished.append(request)
        return finished

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """Forget a step whose results will never come (the runner failed): nothing advances, and
        the scheduled requests keep their blocks, so the next schedule() runs them again (or the
        engine finishes them). Idempotent; the output must be the latest one."""
        if scheduler_output.step_id == self._num_steps:
            self._pending = None
