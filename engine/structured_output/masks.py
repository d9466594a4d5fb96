"""Per-sequence grammar state and the host-side fill of packed token bitmasks.

A `GrammarState` wraps one llguidance matcher: the engine feeds it the tokens each step kept
(`accept`, after Scheduler.update), and the batch builder asks for its next-token mask. Masks are
packed int32 words, bit j of word w allowing token 32 * w + j (llguidance's layout); the EOS ids
are allowed exactly when the grammar accepts, and a finished grammar allows only EOS.
`MaskFiller.fill` computes the rows of one step in parallel (llguidance's executor, which drops the
GIL) straight into the step's flat input buffer.
"""

from __future__ import annotations

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int):
        self.matcher = matcher
        self.mask_words = mask_words  # words llguidance writes per row (a virtual EOS may add one)
        self.num_tokens = 0  # tokens consumed

    def accept(self, tokens: list[int]) -> bool:
        """Consumes sampled tokens; False when the grammar rejected one (then `error` says why)."""
        if not tokens:
            return True
        ok = self.matcher.consume_tokens(list(tokens))
        self.num_tokens += len(tokens)
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no more tokens (only EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None


class MaskFiller:
    def __init__(self, num_threads: int | None = None):
        self._num_threads = num_threads
        self._executor = None

    def fill(self, states: list[GrammarState], rows: np.ndarray, mask: np.ndarray) -> None:
        """mask: int32[M, W], C-contiguous; row rows[i] gets the next-token mask of states[i]."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        width = mask.shape[1]
        if all(s.mask_words == width for s in states):
            fill_next_token_bitmask_par(self._executor, [(s.matcher, int(r)) for s, r in zip(states, rows)], mask)
            return
        # llguidance's rows are wider (a virtual EOS past the vocabulary): fill aside, keep W words.
        scratch = np.zeros((len(states), max(s.mask_words for s in states)), np.int32)
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], scratch)
        mask[rows] = scratch[:, :width]


class BadWordsState:
    """vLLM's bad_words for words of several tokens: the last token of a word is banned whenever
    the output so far ends with the word's other tokens. (Single-token words are banned for good
    through the request's logit-bias row instead.)"""

    def __init__(self, sequences: list[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences if len(s) > 1]
        self.longest = max((len(s) for s in self.sequences), default=1)
        self.recent: list[int] = []  # the last longest - 1 output tokens

    def accept(self, tokens: list[int]) -> bool:
        self.recent = (self.recent + list(tokens))[-(self.longest - 1):] if self.longest > 1 else []
        return True

    def banned(self) -> list[int]:
        out = []
        for seq in self.sequences:
            n = len(seq) - 1
            if len(self.recent) >= n and tuple(self.recent[-n:]) == seq[:-1]:
                out.append(seq[-1])
        return out

    def clear_bits(self, row: np.ndarray) -> None:
        """row: int32[W] packed mask; clears the bits of the banned tokens."""
        ids = np.asarray(self.banned(), np.int64)
        if ids.size:
            words = row.view(np.uint32)
            np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
