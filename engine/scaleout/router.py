"""The data-parallel router: which replica gets a new request (prefix affinity, then load).

Each replica has its own prefix cache, so a request whose prompt starts like one a replica has
already served should go there (its prefill is then a cache hit); otherwise the replica with the
fewest outstanding tokens gets it. As in SGLang's cache-aware router, the router keeps its own
approximate picture of each replica's cache instead of asking the schedulers: the chained hashes
of the full blocks of every prompt it routed there (an LRU as large as that replica's KV pool), so
a burst of requests that share a system prompt follows the first one before its prefill has run.

1. `route(token_ids, cost)`: the hashes of the prompt's full blocks; for each replica the number
   of leading blocks it holds. The replica with the longest match wins if it matches at least
   `min_match_fraction` of the prompt's full blocks (one at least: a common first block, a BOS
   and a chat header, is no affinity) and is not overloaded (its outstanding tokens at most `balance_rel` times the least
   loaded replica's plus `balance_abs`); else the least loaded replica (lowest index on ties).
   The prompt's hashes are recorded for the chosen replica and its load grows by `cost`.
2. `finish(replica, cost)`: the request left; its cost comes off the replica's load.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class RouterStats:
    num_routed: list[int]  # requests sent to each replica
    num_affinity_hits: int  # requests sent where their prefix was (at least one full block)
    outstanding_tokens: list[int]  # per replica: prompt + max_tokens of requests in flight


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, *, block_size: int, capacity_blocks: int,
                 balance_rel: float = 1.5, balance_abs: int = 1024, min_match_fraction: float = 0.25):
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.balance_rel = balance_rel
        self.balance_abs = balance_abs
        self.min_match_fraction = min_match_fraction
        self._cached = [collections.OrderedDict() for _ in range(num_replicas)]
        self._load = [0] * num_replicas
        self._routed = [0] * num_replicas
        self._hits = 0

    def block_hashes(self, token_ids) -> list[int]:
        bs, parent, out = self.block_size, 0, []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash((parent, tuple(token_ids[start : start + bs])))
            out.append(parent)
        return out

    def _match(self, replica: int, hashes: list[int]) -> int:
        cached = self._cached[replica]
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n

    def route(self, token_ids, cost: int) -> int:
        hashes = self.block_hashes(token_ids)
        least = min(range(len(self._load)), key=lambda r: self._load[r])
        matches = [self._match(r, hashes) for r in range(len(self._load))]
        best = max(range(len(matches)), key=lambda r: (matches[r], -self._load[r]))
        limit = self._load[least] * self.balance_rel + self.balance_abs
        enough = matches[best] >= max(1, self.min_match_fraction * len(hashes))
        chosen = best if enough and self._load[best] <= limit else least
        self._hits += matches[chosen] > 0
        cached = self._cached[chosen]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)
        self._load[chosen] += cost
        self._routed[chosen] += 1
        return chosen

    def finish(self, replica: int, cost: int) -> None:
        self._load[replica] -= cost

    def stats(self) -> RouterStats:
        return RouterStats(list(self._routed), self._hits, list(self._load))
