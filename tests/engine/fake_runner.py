"""A fake runner for engine-loop tests: no model, a hand-computable next token.

The next token of a sequence is `next_token(all its tokens)`, so the expected output of any request
is computable without a model. The runner keeps what it has been fed per request (its "KV cache"),
follows the scheduler's join/leave lists exactly as ModelRunner does (so a request resumed after
preemption is re-fed from its start), and can be told to raise at a chosen step.
"""

from __future__ import annotations

from scheduler import SchedulerOutput, StepResult, TokenLogprobs


def next_token(tokens: list[int], vocab: int) -> int:
    return (sum(tokens) * 31 + len(tokens) * 17) % (vocab - 2) + 2  # never 0 or 1


def expected_output(prompt: list[int], max_tokens: int, vocab: int, next_token=next_token) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(seq, vocab)
        seq.append(t)
        out.append(t)
    return out


class FakeRunner:
    def __init__(self, vocab: int = 256, next_token=next_token):
        self.sample_vocab_size = vocab
        self.next_token = next_token  # (tokens, vocab) -> the greedy next token
        self.fed: dict[str, list[int]] = {}
        self.joined: set[str] = set()  # joined, not yet run
        self.num_steps = 0
        self.fail_at_step: int | None = None  # execute() number that raises
        self.healthy = True

    def execute(self, out: SchedulerOutput) -> StepResult:
        for ids in (out.finished_req_ids, out.aborted_req_ids, out.preempted_req_ids):
            for req_id in ids:
                self.fed.pop(req_id, None)
        for new in out.new_requests:
            assert new.req_id not in self.fed, f"{new.req_id} joined twice"
            # A prefix-cache hit starts past 0: those tokens' "KV" is what the request holds.
            self.fed[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.joined.add(new.req_id)
        self.num_steps += 1
        if self.fail_at_step == self.num_steps:
            raise RuntimeError("injected fault")
        req_ids, tokens, logprobs, rejected = [], [], [], []
        for sr in out.scheduled:
            seq = self.fed[sr.req_id]
            if sr.req_id in self.joined:
                self.joined.discard(sr.req_id)
                del seq[sr.num_computed_tokens :]
            assert len(seq) == sr.num_computed_tokens, (sr.req_id, len(seq), sr.num_computed_tokens)
            seq.extend(sr.token_ids)
            if sr.num_logits:
                # num_logits > 1: the row carries drafts; keep samples while they equal them
                # (greedy verification), then the first that differs, and forget the rest.
                n = sr.num_logits
                drafts = sr.token_ids[len(sr.token_ids) - n + 1 :]
                kept = []
                for j in range(n):
                    kept.append(self.next_token(seq[: len(seq) - n + 1 + j], self.sample_vocab_size))
                    if j == n - 1 or kept[-1] != drafts[j]:
                        break
                del seq[len(seq) - (n - len(kept)) :]
                req_ids.append(sr.req_id)
                tokens.append(kept)
                rejected.append(n - len(kept))
                logprobs.append([TokenLogprobs(-0.5, [t], [-0.5]) for t in kept])
        return StepResult(req_ids, tokens, logprobs, rejected)
