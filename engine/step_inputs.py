"""StepInputs: everything one compiled step reads, as one pytree, and the batch builder that fills it.

Shapes are padded to a bucket: T tokens, S sequences (DESIGN.md section 5). On the host every field
is a view into ONE flat int32 buffer per bucket (float32 and uint32 fields are bit-cast views), so
a step moves all of its inputs to the device in one transfer; inside the compiled step
`StepLayout.unpack` slices the flat array back into StepInputs with static offsets. Buffers are
allocated once per bucket and refilled every step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
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
    penalty_tokens: jax.Array  # int32[S, H] output ids, prompt ids + vocab, -1 = none (H = max_model_len)
    flags: jax.Array  # int32[4] any row: [samples randomly, uses a filter, uses a penalty, wants logprobs]


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


class StepLayout:
    """Where each StepInputs field of one bucket lives in the flat int32 buffer."""

    def __init__(self, padded_tokens: int, padded_seqs: int, max_blocks_per_seq: int, history_len: int):
        t, s = padded_tokens, padded_seqs
        shapes = {
            "input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "query_start_loc": (s + 1,),
            "seq_lens": (s,), "block_tables": (s, max_blocks_per_seq), "logits_indices": (s,),
            "num_seqs": (), "top_k": (s,), "rng_seeds": (s,), "rng_steps": (s,),
            "penalty_tokens": (s, history_len), "flags": (4,), **dict.fromkeys(_FLOAT_FIELDS, (s,)),
        }
        self.slices: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            self.slices[name] = (offset, offset + size, shape)
            offset += size
        self.size = offset
        self.buffer = np.zeros(offset, np.int32)
        self.views = {name: self._view(name) for name in shapes}

    def _view(self, name: str) -> np.ndarray:
        start, end, shape = self.slices[name]
        flat = self.buffer[start:end]
        if name in _FLOAT_FIELDS:
            flat = flat.view(np.float32)
        elif name == "rng_seeds":
            flat = flat.view(np.uint32)
        return flat.reshape(shape)

    def unpack(self, flat: jax.Array) -> StepInputs:
        """Inside the compiled step: the flat int32[size] array back into StepInputs."""
        fields = {}
        for name, (start, end, shape) in self.slices.items():
            x = flat[start:end].reshape(shape)
            if name in _FLOAT_FIELDS:
                x = jax.lax.bitcast_convert_type(x, jnp.float32)
            elif name == "rng_seeds":
                x = jax.lax.bitcast_convert_type(x, jnp.uint32)
            fields[name] = x
        return StepInputs(**fields)


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
    """Turns a SchedulerOutput into the flat input buffer of its bucket."""

    def __init__(self, *, max_blocks_per_seq: int, block_size: int, history_len: int, vocab_size: int):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.history_len = history_len
        self._layouts: dict[tuple[int, int], StepLayout] = {}

    def layout(self, padded_tokens: int, padded_seqs: int) -> StepLayout:
        key = (padded_tokens, padded_seqs)
        if key not in self._layouts:
            self._layouts[key] = StepLayout(padded_tokens, padded_seqs, self.max_blocks_per_seq,
                                            self.history_len)
        return self._layouts[key]

    def build(self, out: SchedulerOutput, padded_tokens: int, padded_seqs: int, row_params,
              histories) -> np.ndarray:
        """row_params(req_id) -> RowParams; histories(req_id) -> (prompt ids, output ids).

        Returns the bucket's flat int32 buffer, every field written (padding included)."""
        layout = self.layout(padded_tokens, padded_seqs)
        v = layout.views
        num_seqs = len(out.scheduled)
        if out.num_batched_tokens > padded_tokens or num_seqs > padded_seqs:
            raise ValueError(f"step of {out.num_batched_tokens} tokens / {num_seqs} seqs exceeds "
                             f"bucket ({padded_tokens}, {padded_seqs})")
        layout.buffer.fill(0)  # padding: token 0 at position 0 in the null block's slots, rows empty
        v["penalty_tokens"].fill(-1)
        v["top_p"].fill(1.0)
        v["repetition_penalty"].fill(1.0)
        bs = self.block_size
        pos = 0
        any_random = any_filter = any_penalty = any_logprobs = False
        for row, sr in enumerate(out.scheduled):
            n = sr.num_scheduled_tokens
            start = sr.num_computed_tokens
            end = pos + n
            v["input_ids"][pos:end] = sr.token_ids
            positions = np.arange(start, start + n, dtype=np.int32)
            v["positions"][pos:end] = positions
            table = np.asarray(sr.block_ids, np.int32)
            v["slot_mapping"][pos:end] = table[positions // bs] * bs + positions % bs
            v["block_tables"][row, : len(table)] = table
            v["query_start_loc"][row + 1] = end
            v["seq_lens"][row] = start + n
            v["logits_indices"][row] = end - 1
            p = row_params(sr.req_id)
            for name in _FLOAT_FIELDS:
                v[name][row] = getattr(p, name)
            v["top_k"][row] = p.top_k
            v["rng_seeds"][row] = p.seed
            prompt, output = histories(sr.req_id)
            v["rng_steps"][row] = len(output)
            any_random |= p.temperature > 0
            any_filter |= p.temperature > 0 and p.uses_filter
            any_logprobs |= p.logprobs
            if p.uses_penalty:
                any_penalty = True
                self._fill_history(v["penalty_tokens"][row], prompt, output)
            pos = end
        v["query_start_loc"][num_seqs + 1 :] = pos
        v["num_seqs"][...] = num_seqs
        v["flags"][:] = (any_random, any_filter, any_penalty, any_logprobs)
        return layout.buffer

    def _fill_history(self, buf: np.ndarray, prompt: list[int], output: list[int]) -> None:
        h = buf.shape[0]
        n_out = min(len(output), h)
        buf[:n_out] = output[:n_out]
        n_prompt = min(len(prompt), h - n_out)
        buf[n_out : n_out + n_prompt] = np.asarray(prompt[:n_prompt], np.int32) + self.vocab_size
