"""Random ragged batches, a float64 numpy oracle, and the call through the public API.

A batch is a dict of numpy arrays: the contract's q, k_pages, v_pages (one layer,
[num_blocks, block_size, Hkv, D]), seq_lens, block_tables, query_start_loc, num_seqs.
`make_stacked_batch` adds a stacked [L, ...] cache and this step's new K/V with its slot_mapping.
"""

import dataclasses

import numpy as np

BATCH_KEYS = ("seq_lens", "block_tables", "query_start_loc", "num_seqs")

GARBAGE = 50.0  # magnitude of values in cache slots no query may see (leaks are obvious)


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: real sequences (q_len, kv_len after the step) plus padding and model shape."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    pad_tokens: int = 0  # extra padding tokens after the real ones
    pad_seqs: int = 0  # extra padded sequence slots (q_len 0, seq_len 0)
    num_kv_heads: int = 1
    group: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    sliding_window: int | None = None
    soft_cap: float | None = None
    extra_blocks_per_seq: int = 1  # padded block-table columns past the longest sequence
    seed: int = 0

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group


def make_batch(case: Case) -> dict:
    """Numpy arrays of the contract; unused cache slots hold large garbage."""
    import ml_dtypes

    rng = np.random.default_rng(case.seed)
    dtype = np.float32 if case.dtype == "float32" else ml_dtypes.bfloat16
    bs, D = case.block_size, case.head_dim
    assert all(0 < q <= kv for q, kv in zip(case.q_lens, case.kv_lens))
    num_real = len(case.q_lens)
    S = num_real + case.pad_seqs
    T = sum(case.q_lens) + case.pad_tokens
    blocks_needed = [-(-kv // bs) for kv in case.kv_lens]
    mb = max(blocks_needed) + case.extra_blocks_per_seq
    num_blocks = 1 + sum(blocks_needed) + 3  # null block 0, live blocks, a few free ones
    perm = rng.permutation(np.arange(1, num_blocks))
    block_tables = np.zeros((S, mb), np.int32)
    k_pages = rng.uniform(-GARBAGE, GARBAGE, (num_blocks, bs, case.num_kv_heads, D))
    v_pages = rng.uniform(-GARBAGE, GARBAGE, (num_blocks, bs, case.num_kv_heads, D))
    used = 0
    for s, (n, kv) in enumerate(zip(blocks_needed, case.kv_lens)):
        block_tables[s, :n] = perm[used : used + n]
        used += n
        for p in range(kv):
            blk, off = block_tables[s, p // bs], p % bs
            k_pages[blk, off] = rng.normal(size=(case.num_kv_heads, D))
            v_pages[blk, off] = rng.normal(size=(case.num_kv_heads, D))
    qsl = np.zeros(S + 1, np.int32)
    qsl[1 : num_real + 1] = np.cumsum(case.q_lens)
    qsl[num_real + 1 :] = qsl[num_real]
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:num_real] = case.kv_lens
    q = rng.normal(size=(T, case.num_q_heads, D))
    return dict(
        q=q.astype(dtype),
        k_pages=k_pages.astype(dtype),
        v_pages=v_pages.astype(dtype),
        seq_lens=seq_lens,
        block_tables=block_tables,
        query_start_loc=qsl,
        num_seqs=np.int32(num_real),
    )


def make_stacked_batch(case: Case, num_layers: int) -> dict:
    """A step over a stacked cache: layer 0 is make_batch(case), each other layer its own K/V/q.

    Returns the batch arrays plus q [L, T, Hq, D], k_cache, v_cache [L, num_blocks, bs, Hkv, D]
    BEFORE this step's write (the new tokens' slots hold garbage), k_new, v_new [L, T, Hkv, D]
    and slot_mapping int32[T] (padding tokens at -1, which write_kv must drop), and
    `written`: per layer, the single-layer batch dict the oracle sees after the write.
    """
    base = make_batch(case)
    bs = case.block_size
    tables, qsl, seq_lens = base["block_tables"], base["query_start_loc"], base["seq_lens"]
    T = base["q"].shape[0]
    slots = np.full(T, -1, np.int32)
    for s in range(int(base["num_seqs"])):
        q_len = int(qsl[s + 1] - qsl[s])
        for i in range(q_len):
            pos = int(seq_lens[s]) - q_len + i
            slots[int(qsl[s]) + i] = tables[s, pos // bs] * bs + pos % bs
    live = slots >= 0
    dtype = base["q"].dtype
    qs, k_caches, v_caches, k_news, v_news, written = [], [], [], [], [], []
    for layer in range(num_layers):
        rng = np.random.default_rng((case.seed, layer))
        if layer == 0:
            q, k_after, v_after = base["q"], base["k_pages"], base["v_pages"]
        else:
            q = rng.normal(size=base["q"].shape).astype(dtype)
            k_after = rng.uniform(-GARBAGE, GARBAGE, base["k_pages"].shape)
            v_after = rng.uniform(-GARBAGE, GARBAGE, base["v_pages"].shape)
            for s in range(int(base["num_seqs"])):
                pos = np.arange(int(seq_lens[s]))
                where = (tables[s, pos // bs], pos % bs)
                k_after[where] = rng.normal(size=(len(pos), *k_after.shape[2:]))
                v_after[where] = rng.normal(size=(len(pos), *v_after.shape[2:]))
            k_after, v_after = k_after.astype(dtype), v_after.astype(dtype)
        k_new = rng.normal(size=(T, *k_after.shape[2:])).astype(dtype)
        v_new = rng.normal(size=(T, *v_after.shape[2:])).astype(dtype)
        k_new[live] = k_after.reshape(-1, *k_after.shape[2:])[slots[live]]
        v_new[live] = v_after.reshape(-1, *v_after.shape[2:])[slots[live]]
        k_before, v_before = k_after.copy(), v_after.copy()
        flat_shape = (-1, *k_after.shape[2:])
        garbage = rng.uniform(-GARBAGE, GARBAGE, (int(live.sum()), *k_after.shape[2:]))
        k_before.reshape(flat_shape)[slots[live]] = garbage.astype(dtype)
        v_before.reshape(flat_shape)[slots[live]] = -garbage.astype(dtype)
        qs.append(q)
        k_caches.append(k_before)
        v_caches.append(v_before)
        k_news.append(k_new)
        v_news.append(v_new)
        written.append({**base, "q": q, "k_pages": k_after, "v_pages": v_after})
    return dict(
        **{key: base[key] for key in BATCH_KEYS},
        q=np.stack(qs),
        k_cache=np.stack(k_caches),
        v_cache=np.stack(v_caches),
        k_new=np.stack(k_news),
        v_new=np.stack(v_news),
        slot_mapping=slots,
        written=written,
    )


def prepare(batch: dict, *, backend: str, sliding_window=None, **tuning):
    """prepare_attention_metadata with the static sizes read off the batch (q [..., T, Hq, D])."""
    from pallas_kernels import prepare_attention_metadata

    num_tokens, num_q_heads, head_dim = batch["q"].shape[-3:]
    cache = batch["k_pages"] if "k_pages" in batch else batch["k_cache"]
    return prepare_attention_metadata(
        *(batch[key] for key in BATCH_KEYS),
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=cache.shape[-2],
        block_size=cache.shape[-3],
        backend=backend,
        sliding_window=sliding_window,
        head_dim=head_dim,
        **tuning,
    )


def attend(batch: dict, *, backend: str, options: dict, interpret=False, **tuning):
    """One-layer attention through the public API: prepare, then the per-layer call (no jit)."""
    from pallas_kernels import ragged_paged_attention

    md = prepare(batch, backend=backend, sliding_window=options.get("sliding_window"), **tuning)
    return ragged_paged_attention(
        batch["q"],
        batch["k_pages"],
        batch["v_pages"],
        md,
        backend=backend,
        interpret=interpret,
        **options,
    )


def case_options(case: Case) -> dict:
    """The case's static attention options."""
    return dict(
        sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap
    )


def oracle(batch: dict, *, sm_scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    """float64 attention straight from the contract, token by token; [T, Hq, D]."""
    q = np.asarray(batch["q"], np.float64)
    k_pages = np.asarray(batch["k_pages"], np.float64)
    v_pages = np.asarray(batch["v_pages"], np.float64)
    bs, hkv = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // hkv
    qsl, seq_lens, tables = batch["query_start_loc"], batch["seq_lens"], batch["block_tables"]
    out = np.zeros_like(q)
    for s in range(int(batch["num_seqs"])):
        kv_len = int(seq_lens[s])
        pos = np.arange(kv_len)
        keys = k_pages[tables[s, pos // bs], pos % bs]  # [kv_len, Hkv, D]
        vals = v_pages[tables[s, pos // bs], pos % bs]
        q_len = int(qsl[s + 1] - qsl[s])
        for i in range(q_len):
            t = int(qsl[s]) + i
            own = kv_len - q_len + i
            visible = pos <= own
            if sliding_window is not None:
                visible &= pos > own - sliding_window
            for h in range(q.shape[1]):
                logits = sm_scale * keys[:, h // group] @ q[t, h]
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                logits = np.where(visible, logits, -np.inf)
                w = np.exp(logits - logits.max())
                out[t, h] = (w / w.sum()) @ vals[:, h // group]
    return out


def random_cases(count: int, seed: int = 1234) -> list[Case]:
    """`count` varied cases covering kinds, GQA 1/2/4/8, head_dim 64/128, block 16/32, dtypes."""
    rng = np.random.default_rng(seed)
    kinds = ("decode", "prefill", "mixed")
    cases = []
    for i in range(count):
        kind = kinds[i % 3]
        group = (1, 2, 4, 8)[i % 4]
        head_dim = (64, 128)[(i // 4) % 2]
        block_size = (16, 32)[(i // 2) % 2]
        dtype = ("float32", "bfloat16")[(i // 3) % 2]
        num_seqs = int(rng.integers(1, 5))
        q_lens, kv_lens = [], []
        for s in range(num_seqs):
            decode = kind == "decode" or (kind == "mixed" and s % 2 == 0)
            q_len = 1 if decode else int(rng.integers(2, 24))
            prior = int(rng.integers(0, 70)) if (decode or rng.random() < 0.6) else 0
            q_lens.append(q_len)
            kv_lens.append(max(prior + q_len, q_len))
        cases.append(
            Case(
                name=f"{i:02d}-{kind}-g{group}-d{head_dim}-b{block_size}-{dtype}",
                q_lens=tuple(q_lens),
                kv_lens=tuple(kv_lens),
                pad_tokens=int(rng.integers(0, 5)) if i % 2 else 0,
                pad_seqs=int(rng.integers(0, 3)) if i % 4 in (1, 2) else 0,
                num_kv_heads=1 if group >= 4 else 2,
                group=group,
                head_dim=head_dim,
                block_size=block_size,
                dtype=dtype,
                sliding_window=int(rng.integers(4, 40)) if i % 7 == 3 else None,
                soft_cap=30.0 if i % 5 == 2 else None,
                seed=i,
            )
        )
    return cases


def tolerance(case: Case) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if case.dtype == "bfloat16" else dict(atol=2e-5, rtol=2e-5)
