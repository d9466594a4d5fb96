"""KVTransfer: moves KV blocks from one runner's paged cache to another's, on other devices.

Three compiled pieces per block-count bucket (powers of two up to the longest sequence's blocks,
compiled at start-up, so nothing compiles while serving):

1. a gather on the source pool: `k[:, ids]`, `v[:, ids]` -> [L, n, block_size, Hkv, D] each, in the
   source cache's sharding (split on KV heads under tensor parallelism);
2. `jax.device_put` of those two arrays onto the destination cache's sharding: JAX's own
   transfer, no host copy of ours, asynchronous like every dispatch;
3. a scatter into the destination cache (donated, so it is updated in place); padded positions
   carry an out-of-range block id and are dropped.

All three are dispatched without waiting; device order puts the scatter before the destination's
next step. Only the arrays of one pool ever meet in one op (DESIGN.md section 12). A thread waits
for each transfer to land, to time it (`TransferStats`), off the step loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass
class TransferStats:
    num_transfers: int = 0  # requests whose KV moved
    num_blocks: int = 0  # blocks moved (real, not padding)
    num_bytes: int = 0  # bytes of those blocks (K and V, every layer)
    num_landed: int = 0  # transfers timed to completion so far
    seconds: float = 0.0  # dispatch to landing, summed over landed transfers
    num_fallbacks: int = 0  # handoffs whose blocks did not fit the decode pool (recomputed there)

    @property
    def gb_per_s(self) -> float:
        landed_bytes = self.num_bytes * self.num_landed / self.num_transfers if self.num_transfers else 0
        return landed_bytes / self.seconds / 1e9 if self.seconds else 0.0


def _replicated_like(array) -> object:
    sharding = array.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding  # one device


class KVTransfer:
    def __init__(self, source_runner, dest_runner, *, max_blocks: int):
        self.source, self.dest = source_runner, dest_runner
        self.buckets = tuple(sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)}))
        k = dest_runner.kv_cache[0]
        self._dest_sharding = k.sharding
        self._dest_ids = _replicated_like(k)
        self._source_ids = _replicated_like(source_runner.kv_cache[0])
        self._dest_num_blocks = k.shape[1]
        self._block_bytes = 2 * k.dtype.itemsize * k.size // k.shape[1]
        self._gather = jax.jit(lambda k, v, ids: (k[:, ids], v[:, ids]))
        self._scatter = jax.jit(
            lambda k, v, nk, nv, ids: (k.at[:, ids].set(nk, mode="drop"), v.at[:, ids].set(nv, mode="drop")),
            donate_argnums=(0, 1), out_shardings=(self._dest_sharding, self._dest_sharding))
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._timer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        for n in self.buckets:  # compile every bucket now: all-padding moves change nothing
            self._move(np.zeros(0, np.int32), np.zeros(0, np.int32), n)
        jax.block_until_ready(self.dest.kv_cache)

    def bucket(self, num_blocks: int) -> int:
        return next(b for b in self.buckets if b >= num_blocks)

    def move(self, source_ids, dest_ids) -> None:
        """Copies source blocks `source_ids` into destination blocks `dest_ids` (same length)."""
        source_ids, dest_ids = np.asarray(source_ids, np.int32), np.asarray(dest_ids, np.int32)
        if not len(source_ids):
            return
        start = time.perf_counter()
        k, v = self._move(source_ids, dest_ids, self.bucket(len(source_ids)))
        with self._lock:
            self.stats.num_transfers += 1
            self.stats.num_blocks += len(source_ids)
            self.stats.num_bytes += len(source_ids) * self._block_bytes
        self._timer.submit(self._time, (k, v), start)

    def _move(self, source_ids, dest_ids, bucket: int):
        n = len(source_ids)
        src = np.zeros(bucket, np.int32)  # padding gathers the null block ...
        src[:n] = source_ids
        dst = np.full(bucket, self._dest_num_blocks, np.int32)  # ... and is dropped by the scatter
        dst[:n] = dest_ids
        k, v = self._gather(*self.source.kv_cache, jax.device_put(src, self._source_ids))
        k, v = jax.device_put((k, v), self._dest_sharding)
        self.dest.kv_cache = self._scatter(*self.dest.kv_cache, k, v, jax.device_put(dst, self._dest_ids))
        return k, v

    def _time(self, arrays, start: float) -> None:
        jax.block_until_ready(arrays)
        with self._lock:
            self.stats.num_landed += 1
            self.stats.seconds += time.perf_counter() - start

    def snapshot(self) -> TransferStats:
        with self._lock:
            return dataclasses.replace(self.stats)
