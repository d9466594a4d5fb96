"""The sliding-window layers' own block group (DESIGN.md section 4; vLLM's hybrid KV cache manager).

A model that mixes sliding-window layers (window W: a query at position p reads keys p - W + 1 .. p)
with global ones keeps two block tables per request: the global layers' (KVCacheManager's own) and
this group's, over a pool of its own (the sliding layers' cache arrays, engine/step/kv_cache.py).
Entry i of either table holds positions i * bs .. i * bs + bs - 1. The global table keeps every
block while its request runs; here, once a request's next query is past a block's window, the block
is released and its entry becomes the null block 0:

  a request with c computed tokens runs its next query at position c, which reads from
  max(0, c - W + 1); so its first `num_out_of_window(c)` = max(0, c - W + 1) // bs blocks are never
  read again (the attention kernels' page range, pallas_kernels/metadata.kv_page_range, starts at
  the same block, so no kernel reads a released entry).

Blocks are released in `Scheduler.update` once the step's tokens are computed (the table the runner
read for that step is not changed before it ran). Between steps a table holds at most
ceil((W - 1) / bs) + 1 blocks (`window_blocks`), plus the new blocks of the step's chunk while it runs
(`num_blocks_needed` bounds what a whole batch can hold).

Prefix caching: blocks are registered under the same chained hashes as the global group's, in this
group's pool. A prefix hit of h blocks (its first uncomputed token at position h * bs) needs the
global blocks 0 .. h - 1 and this group's blocks lo(h) .. h - 1, lo(h) = num_out_of_window(h * bs):
those the first query's window reads; the entries before lo(h) start as the null block.
`longest_hit` finds the longest such h. A released block that holds a hash stays cached (ref count
0, evicted LRU) like any other, so a later request with the same prefix can take it back.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_pool import NULL_BLOCK_ID, BlockPool


def num_out_of_window(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks that no query at position >= num_computed reads."""
    return max(0, num_computed - window + 1) // block_size


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a request's table holds between steps, ceil((W - 1) / bs) + 1: those its
    next query's window reads (experiments/capacity.py kv_bytes_held counts them too)."""
    return -(-(window - 1) // block_size) + 1


def num_blocks_needed(*, window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int) -> int:
    """The most blocks a running batch can hold in the sliding group at once, plus the null block:
    each running request its window's blocks (ceil((W - 1) / bs) + 1), plus one partly filled block
    and the new blocks of each scheduled chunk (the chunks share the step's token budget); never
    more than max_num_seqs whole sequences. A pool of this size is never short."""
    per_seq = window_blocks(window, block_size) + 1
    chunks = -(-max_num_batched_tokens // block_size)
    whole = max_num_seqs * -(-max_model_len // block_size)
    return min(max_num_seqs * per_seq + chunks, whole) + 1


class SlidingGroup:
    """The sliding layers' block tables over their own BlockPool."""

    def __init__(self, num_blocks: int, window: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.window = window
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}
        self._num_released: dict[str, int] = {}  # leading entries set to the null block
        self._num_registered: dict[str, int] = {}  # leading entries offered to the prefix cache

    def longest_hit(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """The largest h <= max_blocks whose blocks lo(h) .. h - 1 are all cached here (0 always
        qualifies). O(max_blocks): a run of consecutive cached blocks ending at each block."""
        lookup, bs, window = self.pool.hash_to_block.get, self.block_size, self.window
        best = run = 0
        for i in range(max_blocks):
            run = run + 1 if lookup(block_hashes[i]) is not None else 0
            h = i + 1
            if run >= h - num_out_of_window(h * bs, window, bs):
                best = h
        return best

    def plan_admission(self, block_hashes: Sequence[int], num_hit_blocks: int,
                       num_blocks: int) -> tuple[int, list[int], int] | None:
        """(lo, hit blocks lo .. num_hit_blocks - 1, new blocks) for a table of `num_blocks`
        entries starting at a prefix hit of num_hit_blocks (checked by `longest_hit`); None when
        the pool cannot hand out the new blocks. Takes no references."""
        lo = num_out_of_window(num_hit_blocks * self.block_size, self.window, self.block_size)
        lookup = self.pool.hash_to_block.__getitem__
        hits = [lookup(h) for h in block_hashes[lo:num_hit_blocks]]
        num_new = max(num_blocks - num_hit_blocks, 0)
        ref_cnt = self.pool.ref_cnt
        num_hits_cached = sum(1 for block_id in hits if ref_cnt[block_id] == 0)
        if num_new > self.pool.num_available_blocks - num_hits_cached:
            return None
        return lo, hits, num_new

    def admit(self, req_id: str, plan: tuple[int, list[int], int]) -> None:
        lo, hits, num_new = plan
        self.pool.touch(hits)
        new = self.pool.allocate(num_new) if num_new else []
        self.block_tables[req_id] = [NULL_BLOCK_ID] * lo + hits + new
        self._num_released[req_id] = lo
        self._num_registered[req_id] = lo + len(hits)

    def extend(self, req_id: str, num_new: int) -> None:
        """Appends num_new blocks (the caller checked `pool.num_available_blocks`)."""
        self.block_tables[req_id].extend(self.pool.allocate(num_new))

    def cache_full_blocks(self, req_id: str, block_hashes: Sequence[int], num_full: int) -> None:
        """Registers entries up to num_full (computed, full, hashed) not registered yet."""
        start = self._num_registered[req_id]
        if num_full <= start:
            return
        table, register = self.block_tables[req_id], self.pool.register
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK_ID:  # released entries were registered before (num_out_of_window <= c // bs)
                register(table[i], block_hashes[i])
        self._num_registered[req_id] = num_full

    def release_out_of_window(self, req_id: str, num_computed: int) -> None:
        """Frees the blocks no later query of the request reads; their entries become null."""
        end = num_out_of_window(num_computed, self.window, self.block_size)
        start = self._num_released[req_id]
        if end <= start:
            return
        table = self.block_tables[req_id]
        released = table[start:end]
        table[start:end] = [NULL_BLOCK_ID] * (end - start)
        self._num_released[req_id] = end
        self.pool.free(released)

    def free(self, req_id: str) -> None:
        table = self.block_tables.pop(req_id, None)
        if table is not None:
            self._num_registered.pop(req_id)
            self.pool.free(table[self._num_released.pop(req_id):])

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request's table holds now (not the null entries)."""
        table = self.block_tables.get(req_id)
        return 0 if table is None else len(table) - self._num_released[req_id]
