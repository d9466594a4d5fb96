"""The proposer interface, and the factory that builds the engine's SpecDecoder from its config.

A proposer is anything with
    method: str
    propose(requests: list[scheduler.Request]) -> list[list[int]]
returning up to k draft tokens per request (possibly none) for rows about to decode; it reads the
requests' tokens and never changes them. Host proposers (ngram.py) compute drafts there and
then; a device proposer either fills placeholders after schedule() (draft_model.py: its own
compiled steps) or drafts on the device from the target's last step (draft_head.py: the target's
final hidden states, kept on the device by the runner). Verification does not depend on the proposer (verify.py).
"""

from __future__ import annotations

from typing import Protocol

from engine.spec_decode.controller import SpecDecoder
from engine.speculative_config import SpeculativeConfig
from scheduler import Request


class Proposer(Protocol):
    method: str

    def propose(self, requests: list[Request]) -> list[list[int]]: ...


def make_spec_decoder(config: SpeculativeConfig | None, runner, *, max_num_batched_tokens: int,
                      proposer=None) -> SpecDecoder | None:
    """The engine's SpecDecoder, or None when speculation is off. A draft_model proposer holds a
    compiled runner and a draft_head proposer reads the target runner's hidden states, so both are
    built with the engine's parts (engine/core/builder.py) and passed in."""
    if config is None:
        return None
    if proposer is not None:
        pass
    elif config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
    else:
        needs = "a draft runner" if config.method == "draft_model" else "a target runner with keep_hidden=True"
        raise ValueError(f"speculative_config.method={config.method!r} needs {needs}: LLMEngine(config) "
                         "builds it from speculative_config.model (LLMEngine.from_parts takes proposer=)")
    shapes = getattr(runner, "shapes", None)
    if shapes is not None and shapes.logits_per_seq != 1 + config.num_speculative_tokens:
        raise ValueError(f"speculative_config.num_speculative_tokens={config.num_speculative_tokens}: "
                         f"the runner was compiled for {shapes.logits_per_seq - 1} drafts per row")
    return SpecDecoder(config, proposer, max_num_batched_tokens=max_num_batched_tokens)
