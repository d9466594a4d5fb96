"""StepInputs: everything one compiled step reads, as one pytree, and the batch builder that fills it.

Shapes are padded to a bucket: T tokens, S sequences, L logit rows (DESIGN.md section 5). On the
host every field is a view into ONE flat int32 buffer per bucket (float32 and uint32 fields are
bit-cast views), so a step moves all of its inputs to the device in one transfer; inside the
compiled step `StepLayout.unpack` slices the flat array back into StepInputs with static offsets.
Buffers are allocated once per bucket and refilled every step. Per-request sampling state lives
in the runner's request table on the device (request_table.py): only the rows that join in
this step carry their values here, so nothing sized max_model_len crosses per step.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.step.request_table import SAMPLING_FIELDS, RequestTable
from engine.structured_output.masks import MaskFiller
from scheduler import SchedulerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    # -- attention (the model) --
    input_ids: jax.Array  # int32[T] token to feed; 0 for padding
    positions: jax.Array  # int32[T] position of each token in its sequence; 0 for padding
    slot_mapping: jax.Array  # int32[T] KV slot (block_id * block_size + offset); null block for padding
    query_start_loc: jax.Array  # int32[S+1] cumulative token offsets; padded rows repeat the end
    seq_lens: jax.Array  # int32[S] KV length after this step; 0 for padded rows
    block_tables: jax.Array  # int32[S, max_blocks_per_seq] block ids; 0 (null block) past the end
    num_seqs: jax.Array  # int32[] number of real rows
    lora_slots: jax.Array  # int32[T] LoRA adapter slot of each token's row (engine/lora/); 0 = none, padding
    # -- sampling: one logit row per sampled position (a row's last num_logits tokens) --
    logits_indices: jax.Array  # int32[L] token index of each logit row; 0 for padding
    logits_slots: jax.Array  # int32[L] request-table slot of the row's request; R for padding
    logits_steps: jax.Array  # int32[L] output index of the token it samples (the rng step)
    # int32[L] prompt scoring: the prompt token whose logprob the row reports (nothing is
    # sampled or counted); -1 for rows that sample
    logits_targets: jax.Array
    flags: jax.Array  # int32[6] any row: [samples randomly, uses a filter, uses a penalty, wants logprobs,
    #                   has a token mask, uses a logit bias]
    # -- request-table joins: rows whose sampling values are not on the device yet --
    join_slots: jax.Array  # int32[S] slot to write; R = no join (dropped)
    join_temperature: jax.Array  # float32[S]
    join_top_k: jax.Array  # int32[S]
    join_top_p: jax.Array  # float32[S]
    join_min_p: jax.Array  # float32[S]
    join_presence_penalty: jax.Array  # float32[S]
    join_frequency_penalty: jax.Array  # float32[S]
    join_repetition_penalty: jax.Array  # float32[S]
    join_seed: jax.Array  # uint32[S]
    # -- token masks (structured output) --
    mask_index: jax.Array  # int32[L] row of token_mask for each logit row; L = unconstrained
    # int32[L, W] packed allowed-token bits; only indexed rows are meaningful. Not in the flat
    # buffer: its own argument of the step, sent only in steps with a constrained row (otherwise
    # the runner passes a resident buffer and flags[4] = 0 skips the mask).
    token_mask: jax.Array
    # -- the sliding layers' group (sliding-window accounting, engine/step/kv_cache.py); None
    #    (absent from the flat buffer) when every layer reads block_tables --
    sliding_slot_mapping: jax.Array | None = None  # int32[T] the token's slot in the sliding layers' cache
    # int32[S, max_blocks_per_seq] the sliding layers' block ids; 0 (null block) where their
    # window has passed and past the end
    sliding_block_tables: jax.Array | None = None

    def join_values(self) -> dict:
        return {name: getattr(self, "join_" + name) for name, _, _ in SAMPLING_FIELDS}


_DTYPES = {f"join_{name}": dtype for name, dtype, _ in SAMPLING_FIELDS}


class StepLayout:
    """Where each StepInputs field of one bucket lives in the flat int32 buffer."""

    def __init__(self, padded_tokens: int, padded_seqs: int, padded_logits: int, max_blocks_per_seq: int,
                 mask_words: int = 1, sliding: bool = False):
        t, s, lg = padded_tokens, padded_seqs, padded_logits
        self.padded_tokens, self.padded_seqs, self.padded_logits = t, s, lg
        shapes = {
            "input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "query_start_loc": (s + 1,),
            "seq_lens": (s,), "block_tables": (s, max_blocks_per_seq), "num_seqs": (),
            "lora_slots": (t,),
            "logits_indices": (lg,), "logits_slots": (lg,), "logits_steps": (lg,), "logits_targets": (lg,), "flags": (6,),
            "join_slots": (s,), **{name: (s,) for name in _DTYPES},
            "mask_index": (lg,),
        }
        if sliding:  # the sliding layers' own slots and tables
            shapes.update(sliding_slot_mapping=(t,), sliding_block_tables=(s, max_blocks_per_seq))
        self.sliding = sliding
        self.slices: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            self.slices[name] = (offset, offset + size, shape)
            offset += size
        self.size = offset
        self.buffer = np.zeros(offset, np.int32)
        self.mask = np.zeros((lg, mask_words), np.int32)  # token_mask's host buffer
        self.views = {name: self._view(name) for name in shapes}

    def _view(self, name: str) -> np.ndarray:
        start, end, shape = self.slices[name]
        flat = self.buffer[start:end]
        dtype = _DTYPES.get(name, np.int32)
        if dtype is not np.int32:
            flat = flat.view(dtype)
        return flat.reshape(shape)

    def unpack(self, flat: jax.Array, token_mask: jax.Array) -> StepInputs:
        """Inside the compiled step: the flat int32[size] array (and the mask) as StepInputs."""
        fields = {"token_mask": token_mask}
        for name, (start, end, shape) in self.slices.items():
            x = flat[start:end].reshape(shape)
            dtype = _DTYPES.get(name, np.int32)
            if dtype is not np.int32:
                x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
            fields[name] = x
        return StepInputs(**fields)


@dataclasses.dataclass
class BuiltStep:
    """A filled buffer plus what the runner needs to read the step's output back."""

    buffer: np.ndarray  # the bucket's flat int32 buffer
    row_slots: np.ndarray  # int32[num_seqs] table slot of each scheduled row
    row_num_logits: np.ndarray  # int32[num_seqs] logit rows of each scheduled row
    num_logits: int  # real logit rows (the first num_logits of L)
    mask: np.ndarray | None = None  # the layout's token_mask buffer when a row is constrained


class BatchBuilder:
    """Turns a SchedulerOutput into the flat input buffer of its bucket."""

    def __init__(self, *, max_blocks_per_seq: int, block_size: int, vocab_size: int = 32,
                 tables: str = "global"):
        """tables (engine/step/kv_cache.py cache_groups): "global", the scheduler's block_ids;
        "both", also the sliding layers' tables and slots (ScheduledRequest.sliding_block_ids, a
        two-group cache); "sliding", block_tables and slot_mapping from sliding_block_ids (every
        layer slides: the one cache group is the sliding pool)."""
        if tables not in ("global", "both", "sliding"):
            raise ValueError(f"BatchBuilder.tables must be global, both or sliding, got {tables!r}")
        self.block_size = block_size
        self.sliding = tables == "both"
        self.tables = tables
        self.max_blocks_per_seq = max_blocks_per_seq
        self.mask_words = -(-vocab_size // 32)
        self._layouts: dict[tuple[int, int, int], StepLayout] = {}
        self.mask_filler = MaskFiller()
        self.mask_seconds = 0.0  # host time spent filling token masks
        self.num_mask_steps = 0  # steps that filled at least one mask row
        self.num_mask_rows = 0

    def layout(self, padded_tokens: int, padded_seqs: int, padded_logits: int) -> StepLayout:
        key = (padded_tokens, padded_seqs, padded_logits)
        if key not in self._layouts:
            self._layouts[key] = StepLayout(*key, self.max_blocks_per_seq, self.mask_words, self.sliding)
        return self._layouts[key]

    def build(self, out: SchedulerOutput, layout: StepLayout, table: RequestTable,
              lora_slot_of: dict[str, int] | None = None) -> BuiltStep:
        """lora_slot_of: req_id -> its adapter's device slot (engine/lora/slots.py); rows absent
        from it, and every row without one, run the base model (slot 0)."""
        v = layout.views
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        num_tokens = out.num_batched_tokens
        if num_tokens > layout.padded_tokens or num_seqs > layout.padded_seqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds bucket "
                             f"({layout.padded_tokens}, {layout.padded_seqs})")
        layout.buffer.fill(0)  # padding: token 0 at position 0 in the null block, rows empty
        bs = self.block_size
        slot_of = table.slot_of
        q_lens = np.fromiter((sr.num_scheduled_tokens for sr in scheduled), np.int32, num_seqs)
        starts = np.fromiter((sr.num_computed_tokens for sr in scheduled), np.int32, num_seqs)
        row_logits = np.fromiter((sr.num_logits for sr in scheduled), np.int32, num_seqs)
        row_prompt = np.fromiter((sr.num_prompt_logits for sr in scheduled), np.int32, num_seqs)
        row_slots = np.fromiter((slot_of[sr.req_id] for sr in scheduled), np.int32, num_seqs)
        num_logits = int(row_logits.sum())
        if num_logits > layout.padded_logits:
            raise ValueError(f"step samples {num_logits} positions, bucket has {layout.padded_logits}")
        ends = np.cumsum(q_lens, dtype=np.int32)
        tables = v["block_tables"]
        # Every layer slides ("sliding"): the tables are the sliding pool's, the same length as
        # block_ids (scheduler/kv_cache_manager.py), so block_ids are not written first.
        global_tables = self.tables != "sliding"
        pos = 0
        for row, sr in enumerate(scheduled):
            end = ends[row]
            v["input_ids"][pos:end] = sr.token_ids
            if global_tables:
                tables[row, : len(sr.block_ids)] = sr.block_ids
            pos = end
        if not global_tables:
            self._fill_tables(tables, scheduled)
        # Positions and slots of every token at once: token i of row r sits at starts[r] + i.
        row_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens)
        positions = np.arange(num_tokens, dtype=np.int32) - np.repeat(ends - q_lens - starts, q_lens)
        v["positions"][:num_tokens] = positions
        v["slot_mapping"][:num_tokens] = tables[row_of_token, positions // bs] * bs + positions % bs
        if layout.sliding:
            self._fill_sliding(v, scheduled, row_of_token, positions)
        v["query_start_loc"][1 : num_seqs + 1] = ends
        v["query_start_loc"][num_seqs + 1 :] = num_tokens
        v["seq_lens"][:num_seqs] = starts + q_lens
        v["num_seqs"][...] = num_seqs
        if lora_slot_of:
            row_lora = np.fromiter((lora_slot_of.get(sr.req_id, 0) for sr in scheduled), np.int32, num_seqs)
            v["lora_slots"][:num_tokens] = row_lora[row_of_token]
        # Logit rows: the last num_logits tokens of each row, in row order.
        logit_row = np.repeat(np.arange(num_seqs, dtype=np.int32), row_logits)
        within = np.arange(num_logits, dtype=np.int32) - np.repeat(np.cumsum(row_logits) - row_logits, row_logits)
        v["logits_indices"][:num_logits] = np.repeat(ends - row_logits, row_logits) + within
        sampled_slots = row_slots[logit_row]
        v["logits_slots"][:num_logits] = sampled_slots
        v["logits_slots"][num_logits:] = table.capacity
        # A scored prompt chunk's first rows score prompt tokens; its sampling row (if any) is
        # output 0 after them.
        prompt_rows = np.repeat(row_prompt, row_logits)
        v["logits_steps"][:num_logits] = table.num_output_np[sampled_slots] + np.maximum(within - prompt_rows, 0)
        v["logits_targets"][:] = -1
        if row_prompt.any():
            self._prompt_targets(v["logits_targets"], scheduled, row_logits, row_prompt, table)
        # Joins: the rows whose values are not on the device yet.
        v["join_slots"][:] = table.capacity
        dirty = table.dirty_np[row_slots]
        join_slots = row_slots[dirty]
        v["join_slots"][: len(join_slots)] = join_slots
        for name, _, _ in SAMPLING_FIELDS:
            v["join_" + name][: len(join_slots)] = table.values_np[name][join_slots]
        random = table.values_np["temperature"][sampled_slots] > 0
        masked = self._fill_masks(layout, table, sampled_slots, (row_logits - row_prompt)[logit_row],
                                  within >= prompt_rows)
        v["flags"][:] = (random.any(), table.uses_filter_np[sampled_slots].any(),
                         table.uses_penalty_np[sampled_slots].any(),
                         table.wants_logprobs_np[sampled_slots].any() or row_prompt.any(), masked,
                         table.uses_bias_np[sampled_slots].any())
        return BuiltStep(layout.buffer, row_slots, row_logits, num_logits, layout.mask if masked else None)

    def _fill_sliding(self, v, scheduled, row_of_token, positions) -> None:
        """The sliding layers' tables (their live tables: null entries where the window has passed)
        and the slots the step's tokens are written at (always in blocks the table holds)."""
        tables, bs = v["sliding_block_tables"], self.block_size
        self._fill_tables(tables, scheduled)
        v["sliding_slot_mapping"][: len(positions)] = tables[row_of_token, positions // bs] * bs + positions % bs

    @staticmethod
    def _fill_tables(tables, scheduled) -> None:
        for row, sr in enumerate(scheduled):
            if sr.sliding_block_ids is None:
                raise ValueError(f"request {sr.req_id!r}: the runner's cache has a sliding layers' group "
                                 "but the step carries no sliding_block_ids (SchedulerConfig.sliding_window)")
            tables[row, : len(sr.sliding_block_ids)] = sr.sliding_block_ids

    @staticmethod
    def _prompt_targets(targets, scheduled, row_logits, row_prompt, table: RequestTable) -> None:
        """The next prompt token of every prompt-scoring logit row (the rows come first in their
        row: positions start .. start + p - 1 score the prompt tokens after them)."""
        first = np.cumsum(row_logits) - row_logits
        for row in np.flatnonzero(row_prompt):
            sr = scheduled[row]
            p = int(row_prompt[row])
            prompt = table.prompts[table.slot_of[sr.req_id]]
            start = sr.num_computed_tokens + 1
            targets[first[row] : first[row] + p] = prompt[start : start + p]

    def _fill_masks(self, layout: StepLayout, table: RequestTable, sampled_slots, logits_of_row,
                    sampling_rows) -> bool:
        """Writes the token mask of every constrained logit row that samples (prompt-scoring rows
        stay unmasked); False when there is none."""
        rows = np.flatnonzero(table.constrained_np[sampled_slots] & sampling_rows)
        if not rows.size:
            return False
        if (logits_of_row[rows] != 1).any():
            raise ValueError("a constrained request (structured output / bad_words) was scheduled with "
                             "draft tokens; speculative decoding must skip constrained requests")
        start = time.perf_counter()
        v = layout.views
        v["mask_index"][:] = layout.padded_logits
        v["mask_index"][rows] = rows
        mask = layout.mask
        states = [table.mask_states[s] for s in sampled_slots[rows]]
        grammar_rows = [r for r, (g, _) in zip(rows, states) if g is not None]
        if grammar_rows:
            self.mask_filler.fill([g for g, _ in states if g is not None], np.asarray(grammar_rows), mask)
        for r, (g, banned) in zip(rows, states):
            if g is None:
                mask[r] = -1
            if banned is not None:
                banned.clear_bits(mask[r])
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1
        self.num_mask_rows += rows.size
        return True
