"""RowParams: what one request's sampling becomes in the runner's request table, and its BiasRow.

The engine computes a RowParams once, when it adds a request (clamped and reduced for the
device: engine/step/request_table.py writes it into the request's slot); the draft-model proposer
(engine/spec_decode/draft_model.py) gives its own rows a greedy one. Plain dataclasses, no jax:
the small type both of them share, below both.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-request sampling values, computed once when the engine adds the request."""

    temperature: float
    top_k: int  # 0 = off; already clamped to the vocabulary
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int  # already reduced to uint32
    logprobs: bool  # wants the top logprobs
    bias: BiasRow | None = None  # the request's logit_bias row (None: no bias)
    # Host-side mask state, one per sequence, advanced by the engine (compare=False: mutable).
    grammar: object = dataclasses.field(default=None, compare=False)  # structured_output GrammarState
    banned: object = dataclasses.field(default=None, compare=False)  # BadWordsState (multi-token)
    # The LoRA adapter (engine/lora/manager.LoadedAdapter) the runner gives the row's tokens; None: base
    lora: object = dataclasses.field(default=None, compare=False)

    @property
    def constrained(self) -> bool:
        """Its logit rows need a host-filled token mask each step. Speculative decoding must skip
        such requests (no draft tokens): the batch builder refuses a constrained row with drafts."""
        return self.grammar is not None or self.banned is not None

    @property
    def uses_penalty(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclasses.dataclass(frozen=True)
class BiasRow:
    """A logit-bias row: `base` everywhere (0, or -inf for allowed_token_ids), then `values` at
    `ids` (unique ids, values final: the host combined bias, allowed ids and banned ids)."""

    base: float
    ids: tuple[int, ...]
    values: tuple[float, ...]
