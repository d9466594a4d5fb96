"""When to speculate: a load switch per step and an acceptance switch per request (pure Python).

Speculation spends idle compute: each draft is one more token in the step. A lightly loaded server
has that compute to spare; a saturated one does not, and there drafts only slow everyone down. So:

- `LoadSwitch` (per step): off when more than `disable_by_batch_size` decode rows run, or when the
  decode rows with their drafts would take more than `disable_by_token_share` of the token budget;
  back on only once both are below `enable_hysteresis` times their threshold, so a load that hovers
  around a threshold does not flip it every step.
- `AcceptanceTracker` (per request): an EMA of accepted / drafted tokens over the request's
  verification steps; below `min_acceptance_rate` the request stops drafting, and every
  `probe_interval` of its decode steps it drafts once more (a probe) so a request whose text turns
  repetitive gets speculation back.
"""

from __future__ import annotations

import dataclasses


class LoadSwitch:
    def __init__(self, *, k: int, disable_by_batch_size: int | None, disable_by_token_share: float,
                 enable_hysteresis: float, max_num_batched_tokens: int):
        self.k = k
        self.max_rows = disable_by_batch_size
        self.max_share = disable_by_token_share
        self.hysteresis = enable_hysteresis
        self.budget = max_num_batched_tokens
        self.on = True
        self.num_switch_offs = 0  # on -> off transitions
        self.num_steps_off = 0  # steps that did not speculate because of the load

    def update(self, num_decode_rows: int) -> bool:
        """Whether this step speculates, given the number of rows that decode in it."""
        share = num_decode_rows * (1 + self.k) / self.budget
        rows_over = self.max_rows is not None and num_decode_rows > self.max_rows
        if self.on:
            if rows_over or share > self.max_share:
                self.on = False
                self.num_switch_offs += 1
        else:
            rows_ok = self.max_rows is None or num_decode_rows <= self.hysteresis * self.max_rows
            if rows_ok and share <= self.hysteresis * self.max_share:
                self.on = True
        if not self.on:
            self.num_steps_off += 1
        return self.on


@dataclasses.dataclass
class _RequestAcceptance:
    ema: float = 1.0  # optimistic start: a new request drafts
    disabled: bool = False
    steps_since_probe: int = 0


class AcceptanceTracker:
    def __init__(self, *, min_acceptance_rate: float, alpha: float, probe_interval: int):
        self.threshold = min_acceptance_rate
        self.alpha = alpha
        self.probe_interval = probe_interval
        self._state: dict[str, _RequestAcceptance] = {}
        self.num_request_disables = 0  # times a request's EMA fell below the threshold

    def wants_drafts(self, req_id: str) -> bool:
        """Called once per decode step of the request while the load switch is on."""
        state = self._state.get(req_id)
        if state is None or not state.disabled:
            return True
        state.steps_since_probe += 1
        if state.steps_since_probe >= self.probe_interval:
            state.steps_since_probe = 0
            return True  # a probe
        return False

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        state = self._state.setdefault(req_id, _RequestAcceptance())
        state.ema += self.alpha * (num_accepted / num_drafted - state.ema)
        disabled = state.ema < self.threshold
        if disabled and not state.disabled:
            self.num_request_disables += 1
            state.steps_since_probe = 0
        state.disabled = disabled

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)

    def ema(self, req_id: str) -> float | None:
        state = self._state.get(req_id)
        return None if state is None else state.ema
