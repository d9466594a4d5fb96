"""Buckets: the finite set of padded step shapes compiled at start-up (DESIGN.md section 5).

A step is padded to (T tokens, S sequences, L logit rows). Token buckets come from the config or
`default_buckets(max_num_batched_tokens)`; each token bucket compiles with ONE sequence count (the
smallest sequence bucket holding min(T, max rows)) and one logit-row count (S * logits_per_seq,
at most T), so there are as many plain executables as token buckets. A shape outside them is an
error, never a recompile.

Prompt scoring (prompt logprobs) needs a logit row per prompt position. With `prompt_scoring`,
the largest token bucket is declared once more with L = T (`scoring_bucket`), used only by a step
whose logit rows no plain bucket holds (one with a scored prompt chunk): a scored prompt then
advances by its share of the token budget, as any prefill, instead of by the few rows the decodes
leave in a plain bucket. It compiles at start-up with the others (`all_buckets`).
"""

from __future__ import annotations

import bisect
import dataclasses


def default_buckets(limit: int, *, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest`, then linear steps of the largest power below 512 (padding
    stays under half, and a small fraction past 512), ending exactly at `limit`.

    Starting at 1 matters on the CPU, where a step's cost grows with its padded token count; on an
    accelerator decode is memory-bound and a caller may start higher to compile fewer buckets."""
    buckets: list[int] = []
    b = smallest
    while b < limit and b < 512:
        buckets.append(b)
        b *= 2
    step = buckets[-1] if buckets else limit
    b = (buckets[-1] + step) if buckets else limit
    while b < limit:
        buckets.append(b)
        b += step
    buckets.append(limit)
    return tuple(sorted(set(buckets)))


def resolve_token_buckets(config) -> tuple[int, ...]:
    if config.token_buckets is not None:
        return config.token_buckets
    return default_buckets(config.max_num_batched_tokens)


def bucket_of(t: int, seq_buckets: tuple[int, ...], logits_per_seq: int) -> Bucket:
    """Token bucket t's shape: the smallest sequence bucket holding min(t, max rows), and
    min(t, S * logits_per_seq) logit rows."""
    s = seq_buckets[bisect.bisect_left(seq_buckets, min(t, seq_buckets[-1]))]
    return Bucket(t, s, min(t, s * logits_per_seq))


def max_logit_rows(config) -> int:
    """Logit rows of the bucket with the most: the most one step can sample or score (the
    scheduler's max_num_logits)."""
    spec = getattr(config, "speculative_config", None)
    lps = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    largest = resolve_token_buckets(config)[-1]
    if config.prompt_scoring_bucket:
        return largest
    return bucket_of(largest, resolve_seq_buckets(config), lps).padded_logits


def resolve_seq_buckets(config) -> tuple[int, ...]:
    if config.seq_buckets is not None:
        return config.seq_buckets
    return default_buckets(config.max_num_seqs)


@dataclasses.dataclass(frozen=True)
class Bucket:
    padded_tokens: int  # T
    padded_seqs: int  # S
    padded_logits: int  # L
    lora_rank: int | None = None  # the LoRA rank bucket (RunnerShapes.lora_ranks); None: max_lora_rank


@dataclasses.dataclass(frozen=True)
class RunnerShapes:
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    max_blocks_per_seq: int
    num_blocks: int
    block_size: int
    num_logprobs: int  # top logprobs computed per row when asked
    sample_vocab_size: int  # ids the tokenizer knows: logits past it are never sampled
    logits_per_seq: int = 1  # logit rows per sequence a bucket holds (1 + k with k drafts)
    prompt_scoring: bool = True  # the largest token bucket also compiles with L = T (scoring_bucket)
    # Blocks of the sliding layers' cache (sliding-window accounting: a two-group cache,
    # engine/step/kv_cache.py); 0: one cache group for every layer.
    num_sliding_blocks: int = 0
    # LoRA rank buckets (EngineConfig.lora_rank_buckets): each shape compiles once per rank, and a
    # step runs in the smallest rank holding every adapter its rows use (0: rows of the base
    # model only, no adapter products). (): one program per shape over the whole max_lora_rank.
    lora_ranks: tuple[int, ...] = ()

    @property
    def max_num_seqs(self) -> int:
        """Rows of the largest bucket: the request table's capacity."""
        return self.seq_buckets[-1]

    def bucket_for(self, num_tokens: int, num_seqs: int, num_logits: int | None = None,
                   ready=None, lora_rank: int = 0) -> Bucket:
        """The smallest declared plain bucket that fits the step; with `ready` (a predicate on
        buckets: compiled yet?), the smallest ready one. The largest bucket is always ready.
        The scoring bucket (always ready: it compiles at start-up) serves a step whose logit rows
        no plain bucket holds. `lora_rank`: the highest rank of the step's adapters (with
        lora_ranks, the bucket's is the smallest that holds it)."""
        if not self.lora_ranks:
            return self._shape_for(num_tokens, num_seqs, num_logits, ready)
        ranks = self.lora_ranks
        rank = ranks[min(bisect.bisect_left(ranks, lora_rank), len(ranks) - 1)]
        ready_shape = None if ready is None else (lambda b: ready(dataclasses.replace(b, lora_rank=rank)))
        return dataclasses.replace(self._shape_for(num_tokens, num_seqs, num_logits, ready_shape),
                                   lora_rank=rank)

    def _shape_for(self, num_tokens: int, num_seqs: int, num_logits: int | None, ready) -> Bucket:
        """bucket_for without the LoRA rank (the bucket's shape)."""
        num_logits = num_seqs if num_logits is None else num_logits
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest token bucket {self.token_buckets[-1]}")
        last = self.token_buckets[-1]
        for t in self.token_buckets[i:]:
            bucket = self.bucket_of(t)
            if ready is not None and t != last and not ready(bucket):
                continue
            if bucket.padded_seqs >= num_seqs and bucket.padded_logits >= num_logits:
                return bucket
        scoring = self.scoring_bucket
        if scoring is not None and scoring.padded_seqs >= num_seqs and scoring.padded_logits >= num_logits:
            return scoring
        raise ValueError(f"a step of {num_seqs} sequences and {num_logits} sampled positions "
                         f"exceeds the largest bucket {self.all_buckets()[-1]}")

    def bucket_of(self, t: int) -> Bucket:
        return bucket_of(t, self.seq_buckets, self.logits_per_seq)

    def buckets(self) -> list[Bucket]:
        """The plain buckets, one per token bucket (and LoRA rank)."""
        return self.with_ranks([self.bucket_of(t) for t in self.token_buckets])

    def with_ranks(self, buckets: list[Bucket]) -> list[Bucket]:
        """Each bucket once per LoRA rank bucket (as they are without rank buckets)."""
        if not self.lora_ranks:
            return buckets
        return [dataclasses.replace(b, lora_rank=r) for b in buckets for r in self.lora_ranks]

    @property
    def scoring_bucket(self) -> Bucket | None:
        """The largest token bucket with a logit row per token, when `prompt_scoring` and its plain
        bucket has fewer (None otherwise)."""
        plain = self.bucket_of(self.token_buckets[-1])
        if not self.prompt_scoring or plain.padded_logits == plain.padded_tokens:
            return None
        return dataclasses.replace(plain, padded_logits=plain.padded_tokens)

    def all_buckets(self) -> list[Bucket]:
        """Every shape the runner compiles: the plain buckets, then the scoring bucket if any."""
        scoring = self.scoring_bucket
        return self.buckets() + (self.with_ranks([scoring]) if scoring is not None else [])

    @property
    def max_logits(self) -> int:
        """The most logit rows a step can have (the scheduler's max_num_logits)."""
        return max(b.padded_logits for b in self.all_buckets())
