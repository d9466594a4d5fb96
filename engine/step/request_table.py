"""The runner's request table: per-request sampling state, on the device, changed by request id.

vLLM's persistent input batch is the model: state that belongs to a request is written once, when
the request joins the running batch, not rebuilt and re-sent at every step.

Host side (`RequestTable`): one slot per live request (capacity R = the largest sequence bucket),
numpy mirrors of each slot's sampling values (a step's flags are computed from them without
touching the device), and how many tokens each request has generated (its rng step).

Device side (`TableState`, a pytree donated to every step like the KV cache):
    temperature f32[R], top_k i32[R], top_p f32[R], min_p f32[R], presence_penalty f32[R],
    frequency_penalty f32[R], repetition_penalty f32[R], seed u32[R]
    output_counts i32[R, V]  occurrences of each token in the request's output (penalties)
    prompt_mask   bool[R, V] tokens of the prompt (the repetition penalty covers the prompt too)
    logit_bias    f32[R, V]  added to the logits: logit_bias, allowed_token_ids (-inf elsewhere)
                             and single-token bad_words (-inf), written once at join

Lifecycle, per step:
 1. `apply(scheduler_output)` drops the finished, aborted and preempted ids, then adds the new
    requests: a slot each, the numpy mirrors written, the slot marked dirty. A request that uses a
    penalty has its prompt and earlier output written into its rows now (`_fill_history`, a fixed
    chunk of tokens per call): the only time a whole request's tokens cross to the device.
 2. The batch builder copies the dirty slots of the rows it schedules into the step's join arrays
    (a slot stays dirty until its request runs in a step that completes); the compiled step
    scatters them into TableState before sampling and adds every sampled token to output_counts.
 3. `commit(...)` after a completed step: the dirty slots that travelled are clean, and each
    request's rng step moves on by the tokens it kept.

Host-side mask state per slot (`mask_states`): a request's grammar (engine/structured_output/)
and its multi-token bad words. The batch builder fills a packed bitmask row from them for each of
the slot's logit rows; the engine advances them with the tokens each step kept. Draft state
(speculative decoding) gets per-slot host arrays here when it lands.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from engine.row_params import BiasRow, RowParams
from scheduler import SchedulerOutput

HISTORY_CHUNK = 512  # tokens written per _fill_history / _fill_bias call (one compiled shape)

# Per-request sampling values: (name, dtype, neutral value for unused slots).
SAMPLING_FIELDS = (
    ("temperature", np.float32, 0.0),
    ("top_k", np.int32, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence_penalty", np.float32, 0.0),
    ("frequency_penalty", np.float32, 0.0),
    ("repetition_penalty", np.float32, 1.0),
    ("seed", np.uint32, 0),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TableState:
    temperature: jax.Array  # float32[R] 0 = greedy
    top_k: jax.Array  # int32[R] 0 = off
    top_p: jax.Array  # float32[R] 1 = off
    min_p: jax.Array  # float32[R] 0 = off
    presence_penalty: jax.Array  # float32[R]
    frequency_penalty: jax.Array  # float32[R]
    repetition_penalty: jax.Array  # float32[R] 1 = off
    seed: jax.Array  # uint32[R] per-request seed
    output_counts: jax.Array  # int32[R, V] count of each token in the output so far
    prompt_mask: jax.Array  # bool[R, V] token occurs in the prompt
    logit_bias: jax.Array  # float32[R, V] added to the logits of rows that use a bias

    def with_joins(self, join_slots, values: dict) -> TableState:
        """Inside the step: scatter the joining rows' values (slot R = no join, dropped)."""
        fields = {name: getattr(self, name).at[join_slots].set(values[name], mode="drop")
                  for name, _, _ in SAMPLING_FIELDS}
        return dataclasses.replace(self, **fields)

    def count_tokens(self, slots, token_ids) -> TableState:
        """Inside the step: output_counts[slot, token] += 1 per sampled row (slot R dropped)."""
        counts = self.output_counts.at[slots, token_ids].add(1, mode="drop")
        return dataclasses.replace(self, output_counts=counts)


def allocate_table_state(capacity: int, vocab_size: int) -> TableState:
    fields = {name: jnp.full((capacity,), neutral, dtype) for name, dtype, neutral in SAMPLING_FIELDS}
    return TableState(**fields, output_counts=jnp.zeros((capacity, vocab_size), jnp.int32),
                      prompt_mask=jnp.zeros((capacity, vocab_size), jnp.bool_),
                      logit_bias=jnp.zeros((capacity, vocab_size), jnp.float32))


def _fill_bias(state: TableState, slot, ids, values, base, reset) -> TableState:
    """Writes one chunk of a bias row: the first chunk (reset) starts from `base` everywhere;
    ids past the vocabulary (padding) are dropped."""
    row = jnp.where(reset, base, state.logit_bias[slot])
    row = row.at[ids].set(values, mode="drop")
    return dataclasses.replace(state, logit_bias=state.logit_bias.at[slot].set(row))


def _fill_history(state: TableState, slot, tokens, kinds, reset) -> TableState:
    """Writes one chunk of a request's history into its rows. kinds: 0 padding, 1 prompt token,
    2 output token; reset (the first chunk) clears the rows first."""
    counts = jnp.where(reset, 0, state.output_counts[slot])
    mask = jnp.where(reset, False, state.prompt_mask[slot])
    vocab = counts.shape[0]
    counts = counts.at[jnp.where(kinds == 2, tokens, vocab)].add(1, mode="drop")
    mask = mask.at[jnp.where(kinds == 1, tokens, vocab)].set(True, mode="drop")
    return dataclasses.replace(state, output_counts=state.output_counts.at[slot].set(counts),
                               prompt_mask=state.prompt_mask.at[slot].set(mask))


class RequestTable:
    def __init__(self, capacity: int, vocab_size: int, *, sharding=None):
        self.capacity = capacity
        self.vocab_size = vocab_size
        # sharding: the replica's replicated NamedSharding (on a mesh), None: the default device.
        if sharding is None:
            self.state = allocate_table_state(capacity, vocab_size)
        else:  # made in place on the mesh (under jax.distributed too: no cross-process copy)
            self.state = jax.jit(lambda: allocate_table_state(capacity, vocab_size), out_shardings=sharding)()
        self.slot_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot
        self.values_np = {name: np.full(capacity, neutral, dtype) for name, dtype, neutral in SAMPLING_FIELDS}
        self.wants_logprobs_np = np.zeros(capacity, np.bool_)
        self.uses_filter_np = np.zeros(capacity, np.bool_)
        self.uses_penalty_np = np.zeros(capacity, np.bool_)
        self.num_output_np = np.zeros(capacity, np.int32)  # tokens generated: the rng step
        self.uses_bias_np = np.zeros(capacity, np.bool_)
        self.constrained_np = np.zeros(capacity, np.bool_)  # has host mask state
        self.mask_states: list[tuple[object, object] | None] = [None] * capacity  # (grammar, banned)
        self.prompts: list[list[int] | None] = [None] * capacity  # targets of prompt scoring
        self.dirty_np = np.zeros(capacity, np.bool_)
        self._fill = jax.jit(_fill_history, donate_argnums=(0,))
        self._fill_bias = jax.jit(_fill_bias, donate_argnums=(0,))

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slot_of

    def apply(self, out: SchedulerOutput) -> None:
        """Drops the ids that left, adds the requests that joined (see the module walkthrough)."""
        for ids in (out.finished_req_ids, out.aborted_req_ids, out.preempted_req_ids):
            for req_id in ids:
                self.remove(req_id)
        for new in out.new_requests:
            self.add(new.req_id, new.sampling, new.prompt_token_ids, new.output_token_ids)

    def add(self, req_id: str, row: RowParams, prompt_token_ids, output_token_ids) -> int:
        if req_id in self.slot_of:
            raise ValueError(f"request table: {req_id!r} is already in the table")
        if not isinstance(row, RowParams):
            raise ValueError(f"request table: {req_id!r} carries no RowParams (got {type(row).__name__})")
        if not self._free:
            raise RuntimeError(f"request table: all {self.capacity} slots are taken")
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        for name, _, _ in SAMPLING_FIELDS:
            self.values_np[name][slot] = getattr(row, name)
        self.wants_logprobs_np[slot] = row.logprobs
        self.uses_filter_np[slot] = row.temperature > 0 and row.uses_filter
        self.uses_penalty_np[slot] = row.uses_penalty
        self.num_output_np[slot] = len(output_token_ids)
        self.dirty_np[slot] = True
        self.uses_bias_np[slot] = row.bias is not None
        self.constrained_np[slot] = row.constrained
        self.mask_states[slot] = (row.grammar, row.banned) if row.constrained else None
        self.prompts[slot] = prompt_token_ids  # the scheduler's list (read, never mutated)
        if row.uses_penalty:
            self._write_history(slot, prompt_token_ids, output_token_ids)
        if row.bias is not None:
            self._write_bias(slot, row.bias)
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return  # never joined (aborted while waiting) or already gone
        self.dirty_np[slot] = False
        self.uses_bias_np[slot] = False
        self.constrained_np[slot] = False
        self.mask_states[slot] = None
        self.prompts[slot] = None
        self._free.append(slot)

    def commit(self, slots: np.ndarray, num_kept: np.ndarray) -> None:
        """After a completed step: the joins it carried are on the device; rng steps advance."""
        self.dirty_np[slots] = False
        np.add.at(self.num_output_np, slots, num_kept)

    def _write_history(self, slot: int, prompt, output) -> None:
        tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(output, np.int32)])
        kinds = np.concatenate([np.ones(len(prompt), np.int32), np.full(len(output), 2, np.int32)])
        for start in range(0, max(len(tokens), 1), HISTORY_CHUNK):
            chunk = np.zeros(HISTORY_CHUNK, np.int32)
            chunk_kinds = np.zeros(HISTORY_CHUNK, np.int32)
            part = tokens[start : start + HISTORY_CHUNK]
            chunk[: len(part)] = part
            chunk_kinds[: len(part)] = kinds[start : start + HISTORY_CHUNK]
            self.state = self._fill(self.state, np.int32(slot), chunk, chunk_kinds, np.bool_(start == 0))

    def _write_bias(self, slot: int, bias: BiasRow) -> None:
        ids = np.asarray(bias.ids, np.int32)
        values = np.asarray(bias.values, np.float32)
        for start in range(0, max(len(ids), 1), HISTORY_CHUNK):
            chunk = np.full(HISTORY_CHUNK, self.vocab_size, np.int32)
            chunk_values = np.zeros(HISTORY_CHUNK, np.float32)
            part = ids[start : start + HISTORY_CHUNK]
            chunk[: len(part)] = part
            chunk_values[: len(part)] = values[start : start + HISTORY_CHUNK]
            self.state = self._fill_bias(self.state, np.int32(slot), chunk, chunk_values,
                                         np.float32(bias.base), np.bool_(start == 0))
