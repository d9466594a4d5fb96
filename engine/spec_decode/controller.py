"""SpecDecoder: the engine's side of speculative decoding, around each step (pure Python).

`prepare(scheduler)` runs before `schedule()`: the load switch decides whether this step drafts,
the acceptance tracker picks the decode rows that may, and the proposer writes their drafts into
`Request.spec_token_ids` (the scheduler clamps and consumes them). `observe(output, result)` runs
after a completed step: per verified row, d drafted, a accepted (d - num_rejected_tokens), a + 1
emitted; the counters below and the request's acceptance EMA follow.
"""

from __future__ import annotations

import dataclasses
import logging

from engine.spec_decode.switch import AcceptanceTracker, LoadSwitch
from engine.speculative_config import SpeculativeConfig
from scheduler import Scheduler, SchedulerOutput, StepResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SpecDecodeStats:
    method: str
    num_speculative_tokens: int
    num_drafts: int = 0  # rows that verified at least one draft
    num_draft_tokens: int = 0  # drafted tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_emitted_tokens: int = 0  # tokens verified rows produced (accepted + one bonus each)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k]
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k]
    num_switch_offs: int = 0  # times the load switch turned speculation off
    num_steps_off: int = 0  # steps without speculation because of the load
    num_request_disables: int = 0  # times a request stopped drafting for low acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified row, the bonus token included (1.0 = no draft accepted)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer, *, max_num_batched_tokens: int):
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.switch = LoadSwitch(k=self.k, disable_by_batch_size=config.disable_by_batch_size,
                                 disable_by_token_share=config.disable_by_token_share,
                                 enable_hysteresis=config.enable_hysteresis,
                                 max_num_batched_tokens=max_num_batched_tokens)
        self.tracker = AcceptanceTracker(min_acceptance_rate=config.min_acceptance_rate,
                                         alpha=config.acceptance_ema_alpha,
                                         probe_interval=config.probe_interval)
        # False: no drafts at all (a baseline on the same compiled engine); a draft model still
        # follows every step, so turning it back on needs no catching up.
        self.enabled = True
        self.num_proposer_errors = 0
        self._stats = SpecDecodeStats(config.method, self.k, accepted_per_position=[0] * self.k,
                                      drafted_per_position=[0] * self.k)

    def set_token_budget(self, max_num_batched_tokens: int) -> None:
        self.switch.budget = max_num_batched_tokens

    def prepare(self, scheduler: Scheduler) -> None:
        decoding = [r for r in scheduler.running.values()
                    if len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens == 1]
        if not self.enabled or not decoding or not self.switch.update(len(decoding)):
            return
        wants = self.tracker.wants_drafts
        # Constrained requests (structured output, multi-token bad_words) get no drafts: their
        # token mask is filled for one position per step (engine/step/step_inputs.py refuses drafts).
        chosen = [r for r in decoding if wants(r.req_id) and not getattr(r.sampling, "constrained", False)]
        if not chosen:
            return
        try:
            proposals = self.proposer.propose(chosen)
        except Exception:  # a proposer fault costs this step its drafts, never the requests
            logger.exception("speculative decoding: the %s proposer failed; this step runs without drafts",
                             self.config.method)
            self.num_proposer_errors += 1
            return
        for request, drafts in zip(chosen, proposals):
            request.spec_token_ids = drafts

    def after_schedule(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """A device proposer (draft_model.py) drafts into the scheduled rows now, once their
        slots are allocated; host proposers drafted in prepare()."""
        fill = getattr(self.proposer, "fill", None)
        if fill is not None:
            fill(out, scheduler)

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        for req_id in (*out.finished_req_ids, *out.aborted_req_ids):
            self.tracker.forget(req_id)
        rejected = result.num_rejected_tokens
        if rejected is None:
            return
        row_of = {rid: i for i, rid in enumerate(result.req_ids)}
        stats = self._stats
        for sr in out.scheduled:
            drafted = sr.num_logits - sr.num_prompt_logits - 1  # scored prompt rows draft nothing
            if drafted <= 0 or sr.req_id not in row_of:
                continue
            accepted = drafted - rejected[row_of[sr.req_id]]
            stats.num_drafts += 1
            stats.num_draft_tokens += drafted
            stats.num_accepted_tokens += accepted
            stats.num_emitted_tokens += accepted + 1
            for i in range(drafted):
                stats.drafted_per_position[i] += 1
            for i in range(accepted):
                stats.accepted_per_position[i] += 1
            self.tracker.observe(sr.req_id, drafted, accepted)

    def stats(self) -> SpecDecodeStats:
        s = self._stats
        return dataclasses.replace(
            s, accepted_per_position=list(s.accepted_per_position),
            drafted_per_position=list(s.drafted_per_position),
            num_switch_offs=self.switch.num_switch_offs, num_steps_off=self.switch.num_steps_off,
            num_request_disables=self.tracker.num_request_disables)
