"""The n-gram proposer (prompt lookup): drafts are the tokens that followed the latest earlier
occurrence of the request's own suffix, on the host, in numpy.

vLLM's meaning of the knobs: the suffix that is looked up is between `prompt_lookup_min` and
`prompt_lookup_max` tokens long; the longest one that occurred before wins. Among its occurrences
the latest with a full continuation of k tokens is taken (else the latest), since recent text
predicts what comes next best. Each request's tokens live in a growing numpy buffer appended to as
tokens arrive, and one lookup is `prompt_lookup_max` vectorized compares over the sequence, so a
proposal costs microseconds and never shows in a step profile. A draft is a point mass (q = 1 on
the drafted token): verification needs no q (verify.py).
"""

from __future__ import annotations

import numpy as np

from scheduler import Request


def longest_suffix_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> int | None:
    """Index just past the chosen earlier occurrence of the longest suffix (min_n..max_n tokens)
    of `tokens`, or None when no suffix of min_n tokens occurred before."""
    n = len(tokens)
    if n < min_n + 1:
        return None
    ends = n - 1  # candidate match ends e = 0 .. n-2 (a continuation starts at e + 1 <= n - 1)
    run = np.ones(ends, np.bool_)
    length = np.zeros(ends, np.int32)
    for i in range(min(max_n, ends)):
        eq = np.zeros(ends, np.bool_)
        eq[i:] = tokens[: ends - i] == tokens[n - 1 - i]  # tokens[e - i] == tokens[n - 1 - i]
        run &= eq
        if not run.any():
            break
        length += run
    best = int(length.max()) if ends else 0
    if best < min_n:
        return None
    candidates = np.flatnonzero(length == best)
    full = candidates[candidates <= n - 1 - k]
    return int((full if len(full) else candidates)[-1]) + 1


class _Tokens:
    """One request's tokens as a numpy buffer, appended to as the request grows."""

    __slots__ = ("request", "buf", "n")

    def __init__(self, request: Request):
        self.request = request
        self.buf = np.zeros(max(64, 2 * request.num_tokens), np.int32)
        self.n = 0

    def sync(self) -> np.ndarray:
        request = self.request
        total = request.num_tokens
        if total > self.n:
            if total > len(self.buf):
                grown = np.zeros(2 * total, np.int32)
                grown[: self.n] = self.buf[: self.n]
                self.buf = grown
            self.buf[self.n : total] = request.token_slice(self.n, total)
            self.n = total
        return self.buf[:total]


class NgramProposer:
    method = "ngram"

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Up to k drafts per request (possibly none)."""
        drafts = []
        cache = self._tokens
        for request in requests:
            entry = cache.get(request.req_id)
            if entry is None or entry.request is not request:
                entry = cache[request.req_id] = _Tokens(request)
            tokens = entry.sync()
            start = longest_suffix_match(tokens, self.min_n, self.max_n, self.k)
            drafts.append([] if start is None else tokens[start : start + self.k].tolist())
        if len(cache) > 2 * len(requests) + 64:  # drop finished requests now and then
            live = {r.req_id for r in requests}
            self._tokens = {rid: e for rid, e in cache.items() if rid in live}
        return drafts
