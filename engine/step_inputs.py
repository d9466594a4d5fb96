"""StepInputs: everything one compiled step reads, as one pytree, and the batch builder that fills it.

Shapes are padded to a bucket: T tokens, S sequences (DESIGN.md section 5). The builder owns numpy
buffers allocated once at the largest bucket; each step fills a prefix of them and sends views of
the bucket's size to the device in one transfer.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from scheduler import SchedulerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    input_ids: jax.Array  # int32[T] token to feed; 0 for padding
    positions: jax.Array  # int32[T] position of each token in its sequence; 0 for padding
    slot_mapping: jax.Array  # int32[T] KV slot (block_id * block_size + offset); null block for padding
    query_start_loc: jax.Array  # int32[S+1] cumulative token offsets; padded rows repeat the end
    seq_lens: jax.Array  # int32[S] KV length after this step; 0 for padded rows
    block_tables: jax.Array  # int32[S, max_blocks_per_seq] block ids; 0 (null block) past the end
    logits_indices: jax.Array  # int32[S] index of each row's last token in input_ids
    num_seqs: jax.Array  # int32[] number of real rows
    temperature: jax.Array  # float32[S] 0 = greedy
    top_k: jax.Array  # int32[S] 0 = off
    top_p: jax.Array  # float32[S] 1 = off
    min_p: jax.Array  # float32[S] 0 = off
    presence_penalty: jax.Array  # float32[S]
    frequency_penalty: jax.Array  # float32[S]
    repetition_penalty: jax.Array  # float32[S] 1 = off
    rng_seeds: jax.Array  # uint32[S] per-request seed (a request's tokens depend on it only)
    rng_steps: jax.Array  # int32[S] the request's output index: the key is fold_in(seed, step)
    penalty_tokens: jax.Array  # int32[S, H] output ids, prompt ids + vocab_size, -1 = none (H = max_model_len)
    flags: jax.Array  # int32[4] any row: [samples randomly, uses a filter, uses a penalty, wants logprobs]


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-request sampling values, precomputed once at add_request (host side)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int  # already reduced to uint32
    logprobs: bool  # wants top logprobs

    @property
    def uses_penalty(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


class BatchBuilder:
    """Turns a SchedulerOutput into padded numpy arrays (buffers reused across steps)."""

    def __init__(self, *, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 block_size: int, history_len: int, vocab_size: int):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_blocks_per_seq = max_blocks_per_seq
        z = lambda shape, dtype=np.int32: np.zeros(shape, dtype)
        self.input_ids, self.positions, self.slot_mapping = z(max_tokens), z(max_tokens), z(max_tokens)
        self.query_start_loc, self.seq_lens = z(max_seqs + 1), z(max_seqs)
        self.block_tables = z((max_seqs, max_blocks_per_seq))
        self.logits_indices = z(max_seqs)
        self.floats = {n: z(max_seqs, np.float32) for n in
                       ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                        "repetition_penalty")}
        self.top_k = z(max_seqs)
        self.rng_seeds = z(max_seqs, np.uint32)
        self.rng_steps = z(max_seqs)
        self.penalty_tokens = np.full((max_seqs, history_len), -1, np.int32)
        self._penalty_rows_dirty: set[int] = set()

    def build(self, out: SchedulerOutput, padded_tokens: int, padded_seqs: int, row_params, histories):
        """row_params(req_id) -> RowParams; histories(req_id) -> (prompt ids, output ids).

        Returns numpy StepInputs of the bucket's shape."""
        bs = self.block_size
        pos = 0
        num_seqs = len(out.scheduled)
        any_random = any_filter = any_penalty = any_logprobs = False
        for i in self._penalty_rows_dirty:
            self.penalty_tokens[i].fill(-1)
        self._penalty_rows_dirty.clear()
        for row, sr in enumerate(out.scheduled):
            n = sr.num_scheduled_tokens
            start = sr.num_computed_tokens
            end = pos + n
            self.input_ids[pos:end] = sr.token_ids
            positions = np.arange(start, start + n, dtype=np.int32)
            self.positions[pos:end] = positions
            table = np.asarray(sr.block_ids, np.int32)
            self.slot_mapping[pos:end] = table[positions // bs] * bs + positions % bs
            self.block_tables[row, : len(table)] = table
            self.block_tables[row, len(table):] = 0
            self.query_start_loc[row + 1] = end
            self.seq_lens[row] = start + n
            self.logits_indices[row] = end - 1
            p = row_params(sr.req_id)
            for name, values in self.floats.items():
                values[row] = getattr(p, name)
            self.top_k[row] = p.top_k
            self.rng_seeds[row] = p.seed
            prompt, output = histories(sr.req_id)
            self.rng_steps[row] = len(output)
            any_random |= p.temperature > 0
            any_logprobs |= p.logprobs
            any_filter |= p.temperature > 0 and p.uses_filter
            if p.uses_penalty:
                any_penalty = True
                self._fill_history(row, prompt, output)
            pos = end
        if pos > padded_tokens or num_seqs > padded_seqs:
            raise ValueError(f"step of {pos} tokens / {num_seqs} seqs exceeds bucket ({padded_tokens}, {padded_seqs})")
        self.input_ids[pos:padded_tokens] = 0
        self.positions[pos:padded_tokens] = 0
        self.slot_mapping[pos:padded_tokens] = 0  # the null block: padding never writes a live block
        self.query_start_loc[0] = 0
        self.query_start_loc[num_seqs + 1 : padded_seqs + 1] = pos
        self.seq_lens[num_seqs:padded_seqs] = 0
        self.block_tables[num_seqs:padded_seqs] = 0
        self.logits_indices[num_seqs:padded_seqs] = 0
        for values in self.floats.values():
            values[num_seqs:padded_seqs] = 0
        self.floats["top_p"][num_seqs:padded_seqs] = 1
        self.floats["repetition_penalty"][num_seqs:padded_seqs] = 1
        self.top_k[num_seqs:padded_seqs] = 0
        T, S = padded_tokens, padded_seqs
        return StepInputs(
            input_ids=self.input_ids[:T], positions=self.positions[:T],
            slot_mapping=self.slot_mapping[:T], query_start_loc=self.query_start_loc[: S + 1],
            seq_lens=self.seq_lens[:S], block_tables=self.block_tables[:S],
            logits_indices=self.logits_indices[:S], num_seqs=np.int32(num_seqs),
            temperature=self.floats["temperature"][:S], top_k=self.top_k[:S],
            top_p=self.floats["top_p"][:S], min_p=self.floats["min_p"][:S],
            presence_penalty=self.floats["presence_penalty"][:S],
            frequency_penalty=self.floats["frequency_penalty"][:S],
            repetition_penalty=self.floats["repetition_penalty"][:S],
            rng_seeds=self.rng_seeds[:S], rng_steps=self.rng_steps[:S],
            penalty_tokens=self.penalty_tokens[:S],
            flags=np.array([any_random, any_filter, any_penalty, any_logprobs], np.int32),
        )

    def _fill_history(self, row: int, prompt: list[int], output: list[int]) -> None:
        h = self.penalty_tokens.shape[1]
        buf = self.penalty_tokens[row]
        n_out = min(len(output), h)
        buf[:n_out] = output[:n_out]
        n_prompt = min(len(prompt), h - n_out)
        buf[n_out : n_out + n_prompt] = np.asarray(prompt[:n_prompt], np.int32) + self.vocab_size
        self._penalty_rows_dirty.add(row)
