"""Moving KV blocks from one runner's paged cache to another's, on other devices.

Block counts are padded to buckets (powers of two up to the longest sequence's blocks), and both
halves compile every bucket at start-up, so nothing compiles while serving:

- `KVGather` (the prefill pool): `k[:, ids]`, `v[:, ids]` -> [L, n, block_size, Hkv, D] each, in the
  source cache's sharding (split on KV heads under tensor parallelism); padding gathers block 0.
  An 8-bit cache (pallas_kernels/kv_quant.py ScaledCache) moves its values and its per-token
  scales ([L, n, block_size, Hkv]; the TPU's rows per page [L, n, W]) alike: every function here
  maps over the cache's arrays, blocks on axis 1.
- `KVScatter` (the decode pool): writes such arrays into its cache (donated, so in place); padded
  positions carry an out-of-range block id and are dropped.

Between them the arrays move with JAX's own transfers: `jax.device_put` onto the destination
cache's sharding in one process (decode_pool.py's DecodePool), or
`jax.experimental.transfer` between processes (RemoteDecodePool). Everything is dispatched without
waiting; device order puts the scatter before the destination's next step. Only the arrays of
one pool ever meet in one op (DESIGN.md section 12).
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


def block_buckets(max_blocks: int) -> tuple[int, ...]:
    return tuple(sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)}))


def cache_formats(runner):
    """The runner's pinned cache formats (ModelRunner.cache_formats: the TPU), chosen by compiling
    its smallest bucket if none is compiled yet; None where the layout is not pinned."""
    if getattr(runner, "pins_cache", False) and runner.cache_formats is None:
        runner.compile_all(progress=False, buckets=runner.shapes.all_buckets()[:1])
    return getattr(runner, "cache_formats", None)


def gather_blocks(k, v, ids):
    """Blocks `ids` of every layer: k[:, ids], v[:, ids] (KVGather's program; each array of an
    8-bit cache alike)."""
    return jax.tree.map(lambda a: a[:, ids], (k, v))


def scatter_blocks(k, v, new_k, new_v, ids):
    """new_k, new_v written at blocks `ids`; out-of-range ids are dropped (KVScatter's program)."""
    return jax.tree.map(lambda a, b: a.at[:, ids].set(b, mode="drop"), (k, v), (new_k, new_v))


def moved_leaves(kv) -> list[jax.Array]:
    """The arrays of a gathered (k, v) in a fixed order (what a transfer between processes moves)."""
    return jax.tree.leaves(kv)


def bucket_of(kv) -> int:
    """The number of blocks a gathered (k, v) holds (its bucket)."""
    return moved_leaves(kv)[0].shape[1]


def _replicated_like(array):
    sharding = array.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding  # one device


class KVGather:
    def __init__(self, runner, buckets: tuple[int, ...]):
        self.runner, self.buckets = runner, buckets
        arrays = jax.tree.leaves(runner.kv_cache)
        self._ids = _replicated_like(arrays[0])
        self.block_bytes = sum(a.dtype.itemsize * a.size // a.shape[1] for a in arrays)  # K and V (and scales)
        # Out in the cache's own sharding (split on KV heads under TP), as the decode cache is:
        # a pull from another process asks for exactly that layout, shard by shard.
        formats = cache_formats(runner)  # the TPU's pinned layout: read in it
        pinned = {} if formats is None else {"in_shardings": (*formats, self._ids)}
        self._gather = jax.jit(gather_blocks, out_shardings=jax.tree.map(lambda a: a.sharding, runner.kv_cache),
                               **pinned)
        for n in buckets:
            jax.block_until_ready(self.gather(np.zeros(n, np.int32)))

    def bucket(self, num_blocks: int) -> int:
        return next(b for b in self.buckets if b >= num_blocks)

    def gather(self, source_ids) -> tuple:
        """The blocks `source_ids`, padded to their bucket with block 0: (k, v), each an array or
        a ScaledCache of arrays."""
        ids = np.zeros(self.bucket(len(source_ids)), np.int32)
        ids[: len(source_ids)] = source_ids
        return self._gather(*self.runner.kv_cache, jax.device_put(ids, self._ids))


class KVScatter:
    def __init__(self, runner, buckets: tuple[int, ...]):
        self.runner = runner
        cache = runner.kv_cache
        self.shardings = jax.tree.map(lambda a: a.sharding, cache)  # (k, v) as the cache holds them
        self._ids = _replicated_like(jax.tree.leaves(cache)[0])
        self.num_blocks = jax.tree.leaves(cache)[0].shape[1]
        self._template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache)
        formats = cache_formats(runner)  # the TPU's pinned layout: kept in place
        pinned = {} if formats is None else {"in_shardings": (*formats, None, None, self._ids)}
        self._scatter = jax.jit(scatter_blocks, donate_argnums=(0, 1), out_shardings=formats or self.shardings,
                                **pinned)
        for n in buckets:  # all-padding writes change nothing
            zeros = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), self.abstract(n))
            self.write([], *zeros)
        jax.block_until_ready(runner.kv_cache)

    def abstract(self, bucket: int):
        """(k, v) of `bucket` blocks as ShapeDtypeStructs on this cache's sharding (what a pull
        from another process asks for)."""
        return jax.tree.map(
            lambda a, sharding: jax.ShapeDtypeStruct((a.shape[0], bucket, *a.shape[2:]), a.dtype, sharding=sharding),
            self._template, self.shardings)

    def write(self, dest_ids, k, v) -> None:
        """Writes k, v (a bucket of blocks, on this cache's sharding) into blocks `dest_ids`."""
        ids = np.full(bucket_of((k, v)), self.num_blocks, np.int32)  # out of range: dropped
        ids[: len(dest_ids)] = dest_ids
        self.runner.kv_cache = self._scatter(*self.runner.kv_cache, k, v, jax.device_put(ids, self._ids))


class TransferClock:
    """TransferStats, with each transfer timed from dispatch to landing by a thread that waits
    for its arrays (off the step loop)."""

    def __init__(self):
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._timer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")

    def started(self, num_blocks: int, num_bytes: int, arrays) -> None:
        start = time.perf_counter()
        with self._lock:
            self.stats.num_transfers += 1
            self.stats.num_blocks += num_blocks
            self.stats.num_bytes += num_bytes
        self._timer.submit(self._time, arrays, start)

    def _time(self, arrays, start: float) -> None:
        jax.block_until_ready(arrays)
        with self._lock:
            self.stats.num_landed += 1
            self.stats.seconds += time.perf_counter() - start

    def fallback(self) -> None:
        with self._lock:
            self.stats.num_fallbacks += 1

    def snapshot(self) -> TransferStats:
        with self._lock:
            return dataclasses.replace(self.stats)
