"""KVCacheManager: the block table of each admitted request, on top of the BlockPool.

Invariants:
- A block table is append-only while its request holds it; `free` drops it whole.
- Each block's ref count equals the number of live block tables that hold it, plus one per pin
  (`import_blocks`, until `release`).
- A request's table covers at least its computed tokens plus those scheduled this step.
- Prefix hits only cover full blocks inside the first `num_tokens - 1` tokens: the last known token
  is always computed (its logits give the next token), and a request never writes a shared block.
- With sliding-window accounting (SchedulerConfig.sliding_window) every request also has a table
  in `sliding` (scheduler/sliding_window.py), of the same length as its global table; both are
  extended together, and a prefix hit needs the blocks of both that the request will read.
"""

from __future__ import annotations

from scheduler import block_pool
from scheduler.block_pool import BlockPool, hash_block_tokens
from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.sliding_window import SlidingGroup


class KVCacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        # Contiguous baseline: reserve a whole max_model_len sequence at admission.
        self.num_reserved_blocks = (
            config.max_blocks_per_seq if config.kv_allocation == "contiguous" else 0
        )
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.block_tables: dict[str, list[int]] = {}
        # Per table, how many leading blocks were already offered to the prefix cache.
        self._num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admissions (prefix caching on)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        # The sliding layers' own tables and pool (sliding-window accounting), or None.
        self.sliding = (None if config.sliding_window is None else SlidingGroup(
            config.num_sliding_blocks, config.sliding_window, config.block_size,
            config.enable_prefix_caching))

    def update_block_hashes(self, request: Request) -> None:
        """Hash each full block of `request` not hashed yet (each block is hashed exactly once)."""
        if not self.enable_prefix_caching:
            return
        hashes, bs = request.block_hashes, self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) >= num_full:
            return
        parent = hashes[-1] if hashes else block_pool.root_hash(request.lora_id)  # read at each use: see block_pool
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, request.token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Blocks of the longest cached prefix of a request not yet admitted (takes no references).

        Computed tokens = len(result) * block_size, always < request.num_tokens.
        """
        if not self.enable_prefix_caching or request.req_id in self.block_tables:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.pool.hash_to_block.get
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.sliding is not None and hits:  # a hit also needs the sliding blocks its window reads
            del hits[self.sliding.longest_hit(request.block_hashes, len(hits)):]
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> list[int] | None:
        """Extend `request`'s table to hold its computed tokens plus `num_new_tokens` more.

        `computed_block_ids` (from `get_computed_blocks`, only at admission) are prefix hits that
        start the table; they count as computed tokens ahead of `request.num_computed_tokens`.
        Returns the newly allocated block ids, or None (changing nothing) when the pool is short.
        """
        bs = self.block_size
        table = self.block_tables.get(request.req_id)
        if table is not None:  # an admitted request growing: the per-step hot path
            if computed_block_ids:
                raise ValueError(
                    f"allocate_slots: {request.req_id!r} is admitted; no prefix hits now"
                )
            num_new_blocks = -(-(request.num_computed_tokens + num_new_tokens) // bs) - len(table)
            if num_new_blocks <= 0:
                return []
            if num_new_blocks > self.pool.num_available_blocks:
                return None
            if self.sliding is not None:  # its table has the same length: as many new blocks
                if num_new_blocks > self.sliding.pool.num_available_blocks:
                    return None
                self.sliding.extend(request.req_id, num_new_blocks)
            new_block_ids = self.pool.allocate(num_new_blocks)
            table.extend(new_block_ids)
            return new_block_ids

        # Admission: prefix hits start the table; contiguous allocation reserves a whole sequence.
        computed = computed_block_ids or []
        num_tokens = request.num_computed_tokens + len(computed) * bs + num_new_tokens
        num_required = max(-(-num_tokens // bs), self.num_reserved_blocks)
        num_new_blocks = max(num_required - len(computed), 0)
        # Hits on ref-0 blocks take them out of the evictable set, so they do not count as room.
        ref_cnt = self.pool.ref_cnt
        num_hits_cached = sum(1 for block_id in computed if ref_cnt[block_id] == 0)
        if num_new_blocks > self.pool.num_available_blocks - num_hits_cached:
            return None
        if self.sliding is not None:
            plan = self.sliding.plan_admission(request.block_hashes, len(computed), num_required)
            if plan is None:
                return None
            self.sliding.admit(request.req_id, plan)
        self.pool.touch(computed)
        new_block_ids = self.pool.allocate(num_new_blocks) if num_new_blocks else []
        self.block_tables[request.req_id] = computed + new_block_ids
        self._num_registered[request.req_id] = len(computed)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * bs
        return new_block_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        req_id = request.req_id
        start = self._num_registered[req_id]
        end = request.num_computed_tokens // self.block_size
        if end <= start:
            return
        self.update_block_hashes(request)
        table, hashes, register = (
            self.block_tables[req_id],
            request.block_hashes,
            self.pool.register,
        )
        for i in range(start, end):
            register(table[i], hashes[i])
        self._num_registered[req_id] = end
        if self.sliding is not None:
            self.sliding.cache_full_blocks(req_id, hashes, end)

    def release_out_of_window(self, request: Request) -> None:
        """Sliding-window accounting: frees the sliding blocks no later query of `request` reads
        (after a step, once its tokens are computed)."""
        if self.sliding is not None:
            self.sliding.release_out_of_window(request.req_id, request.num_computed_tokens)

    def import_blocks(self, block_hashes: list[int]) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Blocks for KV computed elsewhere (prefill/decode disaggregation), keyed by the chained
        hashes of a prompt's full blocks (block_pool.hash_block_tokens, as `update_block_hashes`
        makes them): a hash already cached keeps its block, every other one gets a new block
        registered under it, so the request that follows finds them all as prefix hits.

        Returns (pinned, to_write): every block of the prefix, pinned (one reference each, until
        `release`) so that no allocation evicts them before their request is admitted; and the
        (position, block id) pairs whose contents the caller must write before the next step.
        None, changing nothing, when the pool cannot hold them."""
        if not self.enable_prefix_caching:
            raise ValueError("import_blocks needs prefix caching: imported blocks are found as prefix hits")
        if self.sliding is not None:
            raise ValueError("import_blocks is not implemented with sliding-window accounting "
                             "(SchedulerConfig.sliding_window): imported blocks carry every layer")
        pool = self.pool
        found = [pool.lookup(h) for h in block_hashes]
        num_misses = found.count(None)
        num_hits_cached = sum(1 for b in found if b is not None and pool.ref_cnt[b] == 0)
        if num_misses > pool.num_available_blocks - num_hits_cached:
            return None
        pool.touch([b for b in found if b is not None])
        new_ids = iter(pool.allocate(num_misses) if num_misses else [])
        pinned, to_write = [], []
        for i, (block_hash, block_id) in enumerate(zip(block_hashes, found)):
            if block_id is None:
                block_id = next(new_ids)
                pool.register(block_id, block_hash)
                to_write.append((i, block_id))
            pinned.append(block_id)
        return pinned, to_write

    def release(self, block_ids: list[int]) -> None:
        """Drops the pins `import_blocks` took (the blocks stay cached until evicted)."""
        self.pool.free(block_ids)

    def free(self, request: Request) -> None:
        """Drop the request's table; full registered blocks stay cached until evicted."""
        table = self.block_tables.pop(request.req_id, None)
        if table is not None:
            self._num_registered.pop(request.req_id)
            self.pool.free(table)
            if self.sliding is not None:
                self.sliding.free(request.req_id)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The live table of `req_id` (empty if it holds none). Do not mutate."""
        return self.block_tables.get(req_id, [])

    def num_allocated_slots(self, req_id: str) -> int:
        return len(self.block_tables.get(req_id, ())) * self.block_size
