"""Engine-side state of a request: its n sequences, their text, stop strings and logprobs.

Stop strings: the text that could still be the start of a stop string is held back (not shown
in `visible_text`), so a streaming client never receives text that is later cut off.
"""

from __future__ import annotations

import dataclasses

from engine.errors import ParamError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.row_params import RowParams
from engine.sampling_params import SamplingParams
from scheduler.outputs import TokenLogprobs
from text.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Resume:
    """A request whose prompt ran in another engine (the prefill pool of
    engine/disaggregation/pd_engine.py): each sequence's output there (its first token, logprobs,
    and finish if it already ended; or, when the decode pool was lost, every token it had made),
    in sequence order, when the first token came, and the prompt's logprobs if they were asked
    for."""

    first: list[CompletionOutput]
    first_token_time: float
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[SequenceState] = dataclasses.field(default_factory=list)
    # SamplingParams.prompt_logprobs: filled by the first sequence's prompt scoring.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add_prompt_logprobs(self, start: int, entries) -> None:
        """entries[j] scores prompt position start + j; positions already had (a resumed
        request scores its prompt again) are skipped."""
        if self.prompt_logprobs is None:
            return
        k = self.params.prompt_logprobs
        for j, lp in enumerate(entries):
            if start + j != len(self.prompt_logprobs):
                continue
            entry = dict(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]))
            entry[self.prompt_token_ids[start + j]] = lp.logprob
            self.prompt_logprobs.append(entry)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index, text=s.visible_text, token_ids=s.request.output_token_ids[: s.token_limit],
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob, error=s.error)
            for s in self.seqs
        ]
        self.metrics.num_cached_tokens = max((s.request.num_cached_tokens for s in self.seqs), default=0)
        scored = self.prompt_logprobs
        done = scored is not None and len(scored) == len(self.prompt_token_ids)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=self.finished, metrics=self.metrics,
                             prompt_logprobs=list(scored) if done else None)


class SequenceState:
    def __init__(self, seq_id: str, index: int, parent: RequestState, request, row: RowParams,
                 tokenizer):
        self.seq_id = seq_id
        self.index = index
        self.parent = parent
        self.request = request  # the scheduler's Request (holds output_token_ids)
        self.row = row
        params = parent.params
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.num_logprobs = params.logprobs
        self.detok = IncrementalDetokenizer(tokenizer, parent.prompt_token_ids,
                                            skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.visible_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.num_tokens_seen = 0  # output tokens already detokenized
        self.error: str | None = None  # why the sequence failed (a step or detokenizer fault)
        self.token_limit: int | None = None  # output tokens kept when a stop string cut a step's tokens

    def append(self, tokens: list[int], logprobs, now: float) -> bool:
        """Takes the tokens a step kept (and their TokenLogprobs, or None); True when a stop
        string ended the sequence."""
        if not tokens:
            return False
        metrics = self.parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if self.stops and len(tokens) > 1:
            # Several tokens in one step (speculative decoding): a stop string may end the
            # sequence inside them; the tokens after the one that completes it are not output.
            for j in range(len(tokens)):
                if self._add(tokens[j : j + 1], None if logprobs is None else logprobs[j : j + 1]):
                    self.token_limit = self.num_tokens_seen
                    return True
            return False
        return self._add(tokens, logprobs)

    def _add(self, tokens: list[int], logprobs) -> bool:
        self.num_tokens_seen += len(tokens)
        if logprobs is not None and self.logprobs is not None:
            k = self.num_logprobs
            for token, lp in zip(tokens, logprobs):
                entry = dict(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]))
                entry[token] = lp.logprob
                self.logprobs.append(entry)
                self.cumulative_logprob += lp.logprob
        previous = len(self.text)
        self.text += self.detok.add(tokens)
        if self.stops and self._check_stop(previous):
            return True
        self.visible_text = self.text[: len(self.text) - self._held_back()]
        return False

    def resume_from(self, first: CompletionOutput, when: float) -> str | None:
        """Starts this sequence with the tokens another engine sampled for it (Resume): its first
        token, or every token it had made when that engine was lost (the prompt and those tokens
        are recomputed here), with the same detokenizer, stop-string and logprob state as if they
        had been sampled here. Returns the finish reason when the sequence already ended there
        (it is not scheduled)."""
        tokens = list(first.token_ids)
        self.request.output_token_ids.extend(tokens)
        logprobs = None
        if first.logprobs:
            logprobs = [self._resumed_logprobs(token, entry) for token, entry in zip(tokens, first.logprobs)]
        self.append(tokens, logprobs, when)
        if first.finish_reason is not None:
            self.finish(first.finish_reason, when)
            self.stop_reason = first.stop_reason
        return self.finish_reason

    def _resumed_logprobs(self, token: int, entry: dict[int, float]) -> TokenLogprobs:
        """An output's logprobs entry back as the sampler's TokenLogprobs."""
        top = sorted((t for t in entry if t != token), key=entry.get, reverse=True)
        if token in entry and len(entry) <= (self.num_logprobs or 0):
            top = sorted(entry, key=entry.get, reverse=True)  # the token was among the top k
        return TokenLogprobs(entry[token], top, [entry[t] for t in top])

    def finish(self, reason: str, now: float) -> None:
        if self.finish_reason is not None:
            return
        if self.stop_reason is None:
            previous = len(self.text)
            self.text += self.detok.flush()
            if self.stops:
                self._check_stop(previous)
        if self.stop_reason is None:
            self.visible_text = self.text
            if reason == "stop" and self.request.output_token_ids:
                self.stop_reason = self.request.output_token_ids[-1]
        self.finish_reason = "stop" if isinstance(self.stop_reason, str) else reason
        self.parent.metrics.finished_time = now

    def _check_stop(self, previous: int) -> bool:
        longest = max(len(s) for s in self.stops)
        start = max(0, previous - longest + 1)
        best = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.visible_text = self.text
        self.stop_reason = s
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        if not self.stops:
            return 0
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


def prompt_ids(prompt: str | list[int], tokenizer, vocab_size: int, max_model_len: int,
               add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids (a string tokenized, a list checked), validated; ParamError naming
    `prompt` otherwise."""
    if isinstance(prompt, str):
        if not prompt:
            raise ParamError("prompt", "prompt: must not be empty")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, list | tuple):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ParamError("prompt", f"prompt: token id {t!r} is not an integer in [0, {vocab_size})")
    else:
        raise ParamError("prompt", f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ParamError("prompt", "prompt: must not be empty")
    if len(ids) >= max_model_len:
        raise ParamError("prompt", f"prompt: {len(ids)} tokens, but max_model_len is {max_model_len} "
                         "(the prompt must leave room for at least one generated token)")
    return ids
