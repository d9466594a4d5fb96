"""BlockPool: ref-counted KV blocks, two free lists, and the prefix cache (hash -> block).

Every block other than the null block 0 is in exactly one of three states:
  used    ref count > 0 (held by at least one live block table);
  cached  ref count 0 but holding a registered hash: its K/V is still valid and a later request
          with the same prefix may take it back; kept in an LRU queue, evicted from the head;
  free    ref count 0 and no hash: fresh, handed out before any cached block is evicted.
So num_free + num_cached + num_used == num_blocks - 1 at all times.

Block hashes chain: hash(block i) = H(hash(block i-1), token ids of block i), so equal hashes mean
equal whole prefixes, not only equal blocks. H is Python's `hash` of a tuple: it runs in C (a block
of 16 ids hashes in well under a microsecond, and each block is hashed once), and the cache lives
and dies with this process, so no stability across processes is needed. The chain starts from a
per-process random seed, so hash values cannot be predicted from outside, which makes a crafted
collision (a prompt that would read another prompt's K/V) impractical; 64-bit values make an
accidental one negligible. A deployment that wants a cryptographic guarantee swaps in hashlib in
`hash_block_tokens`; nothing else depends on the choice.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0

# Parent hash of the first block of every sequence; random per process (see module docstring).
# Processes that share blocks by hash must share it: a decode pool in another process
# (engine/disaggregation/decode_pool.py) takes its leader's before it builds its engine. Read it as
# `block_pool.ROOT_BLOCK_HASH` at each use, never imported by name.
ROOT_BLOCK_HASH = random.SystemRandom().getrandbits(62)


def root_hash(lora_id: int = 0) -> int:
    """The parent hash of a sequence's first block: ROOT_BLOCK_HASH for the base model, one of
    its own per LoRA adapter load (Request.lora_id), so the same tokens under two adapters, or
    under an adapter and the base model, never share a block (their K/V differ)."""
    if not lora_id:
        return ROOT_BLOCK_HASH
    return hash((ROOT_BLOCK_HASH, "lora", lora_id))


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The prefix-cache key of one full block, chained on its parent's key."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """Owns ref counts and the prefix cache of `num_blocks` blocks (block 0 never handed out)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"BlockPool.num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        # Hash registered for each block, or None. A used block may hold one too (it is shared).
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks with no hash. A stack popped from the end; reversed so block 1 goes first.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        # Cached blocks (ref count 0, hash registered), least recently used first. An OrderedDict
        # gives O(1) append, pop from the head, and removal from the middle (a prefix hit).
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.num_evictions = 0

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no hash and ref count 0."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref count 0 whose contents are still in the prefix cache (evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free) - len(self._cached)

    @property
    def num_available_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones, then evicted cached ones."""
        return len(self._free) + len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free (never cached or evicted) blocks, in no particular order (tests, debugging)."""
        return list(self._free)

    def cached_block_ids_lru(self) -> list[int]:
        """The cached blocks, next to be evicted first (for tests and debugging)."""
        return list(self._cached)

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, block_hash: int) -> int | None:
        """The block registered under `block_hash`, or None."""
        return self.hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Record that `block_id` (used, full, computed) holds the block keyed by `block_hash`.

        Returns False (and registers nothing) when another block already holds that content, or
        this block is already registered: the cache maps each hash to one block.
        """
        if not self.enable_prefix_caching or block_hash in self.hash_to_block:
            return False
        if self.block_hash[block_id] is not None:
            return False
        self.hash_to_block[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    # -- ref counts --------------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hits); a cached block leaves the LRU."""
        ref_cnt, cached = self.ref_cnt, self._cached
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del cached[block_id]  # a ref-0 block reached through the hash map is cached
            ref_cnt[block_id] += 1

    def allocate(self, num: int) -> list[int]:
        """Hand out `num` blocks with ref count 1. The caller checks num_available_blocks first."""
        if num > len(self._free) + len(self._cached):
            raise ValueError(
                f"BlockPool.allocate: asked for {num} blocks, only {self.num_available_blocks} available"
            )
        out: list[int] = []
        free, ref_cnt = self._free, self.ref_cnt
        for _ in range(num):
            if free:
                block_id = free.pop()
            else:
                # Evict the least recently used cached block: its old contents are overwritten.
                block_id, _ = self._cached.popitem(last=False)
                del self.hash_to_block[self.block_hash[block_id]]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, last block first.

        Blocks reaching ref count 0 go to the cached LRU tail if they hold a hash, else to the free
        list. Freeing a table tail first means a sequence's tail blocks are evicted before its head
        blocks, which other requests are likelier to share.
        """
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        for block_id in reversed(block_ids):
            if ref_cnt[block_id] <= 0:
                raise RuntimeError(f"BlockPool.free: block {block_id} freed more often than held")
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                if block_hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached[block_id] = None
