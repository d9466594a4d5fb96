"""DecodePool: the decode pool of prefill/decode disaggregation in this process, and the failed
output of a handover.

The pool wraps the decode pool's LLMEngine and the KVScatter that writes moved blocks into its
cache (kv_transfer.py). PDEngine (pd_engine.py) calls it directly when both pools are in one
process; a decode process (decode_process.py) runs one for its leader, which reaches it through
RemoteDecodePool (decode_pool.py, where the protocol between the two is described). Both offer
PDEngine the same calls (`hand_over`, `step`, `abort_request`, `num_pending`, ...).
"""

from __future__ import annotations

import dataclasses


class DecodePool:
    def __init__(self, engine, scatter):
        self.engine, self.scatter = engine, scatter
        self._pinned: dict[str, list[int]] = {}
        self._n: dict[str, int] = {}
        self.pull_seconds, self.num_pulled = 0.0, 0  # remote pulls (timed where they land)
        self.num_blocks = scatter.num_blocks  # the cache's blocks; an id this large is dropped

    @property
    def dead_reason(self) -> str | None:
        return self.engine.dead_reason

    @property
    def num_pending(self) -> int:
        return len(self._pinned)

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pinned

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def accept(self, request_id: str, hashes: list[int]) -> list[tuple[int, int]] | None:
        imported = self.engine.scheduler.kv_cache_manager.import_blocks(hashes)
        if imported is None:
            return None
        self._pinned[request_id], to_write = imported
        return to_write

    def write(self, dest_ids, k, v) -> None:
        self.scatter.write(dest_ids, k, v)

    def dest_ids(self, num_hashes: int, to_write) -> list[int]:
        """Where each gathered block goes; blocks held already get an out-of-range id (dropped)."""
        dest = [self.num_blocks] * num_hashes
        for position, block in to_write:
            dest[position] = block
        return dest

    def hand_over(self, request_id: str, hashes: list[int], k, v, *add_args, **add_kwargs) -> bool:
        """Pins and writes the moved blocks, then queues the request; False when the pool had no
        room for them (it recomputes the prompt)."""
        to_write = self.accept(request_id, hashes)
        if to_write:
            self.write(self.dest_ids(len(hashes), to_write), k, v)
        self.add_request(request_id, *add_args, **add_kwargs)
        return to_write is not None

    def add_request(self, request_id: str, prompt_ids, params, arrival, **kwargs) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params, arrival, **kwargs)
        except Exception:
            self._unpin(request_id)
            raise
        self._n[request_id] = params.n

    def abort_request(self, request_id: str) -> bool:
        self._forget(request_id)
        return self.engine.abort_request(request_id)

    def step(self) -> list:
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        for request_id in [r for r in self._pinned if self._admitted(r)]:
            self._unpin(request_id)
        return outputs

    def get_stats(self):
        return self.engine.get_stats()

    def last_stats(self):
        return self.engine.get_stats()

    def abandon(self) -> None:
        """The leader stops using this pool (its engine died): its requests are aborted, which
        frees their blocks and pins."""
        for request_id in set(self._n) | set(self._pinned):
            self.abort_request(request_id)

    def reconfigure_scheduler(self, **changes):
        if self._pinned:
            raise ValueError("reconfigure_scheduler needs an idle engine: KV transfers are pending")
        return self.engine.reconfigure_scheduler(**changes)

    def _admitted(self, request_id: str) -> bool:
        """Every live sequence of the request is admitted (its table holds the moved blocks)."""
        get, n = self.engine.scheduler.get_request, self._n.get(request_id, 1)
        seqs = [get(request_id)] if n == 1 else [get(f"{request_id}#{i}") for i in range(n)]
        return all(s is None or s.num_computed_tokens > 0 for s in seqs)

    def _forget(self, request_id: str) -> None:
        self._n.pop(request_id, None)
        self._unpin(request_id)

    def _unpin(self, request_id: str) -> None:
        pinned = self._pinned.pop(request_id, None)
        if pinned:
            self.engine.scheduler.kv_cache_manager.release(pinned)


def failed_output(out, exc: Exception, what: str = "KV handover failed"):
    """`out` (a RequestOutput) ended: every sequence aborted with the error."""
    failed = [dataclasses.replace(c, finish_reason="abort", error=f"{what}: {exc}") for c in out.outputs]
    return dataclasses.replace(out, outputs=failed, finished=True)
