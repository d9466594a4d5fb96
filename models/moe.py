"""A mixture-of-experts MLP: top-k routing, dropless, as grouped products over tokens sorted by expert.

Axes: t tokens, e hidden, E experts (x for one expert's index), f an expert's MLP width, a the
t * k (token, choice) assignments.

    logits = x @ router.T                      [t, E] (float32)
    probs = softmax(logits); w, idx = top_k(probs, k); w /= sum(w) if norm_topk_prob
    (Mixtral always renormalizes: the softmax over the chosen logits; Qwen3-MoE per its config)
    assignments sorted by expert -> rows x[token_of[a]] [a, e], group_sizes [E]
    h = act(gate) * up of ragged_dot(rows, experts_gate_up)   [a, f]
    y = ragged_dot(h, experts_down) * w[a]                     [a, e]
    out[t] = sum of y over t's k assignments                   [t, e]

Every shape is fixed by t and k (the routing only changes `group_sizes` and the sort order), so the
step never recompiles for routing and no token is dropped. Weights (served layout, out-major per
expert, as Hugging Face's fused MoE tensors): router [E, e], experts_gate_up [E, 2f, e] (gate rows,
then up rows), experts_down [E, e, f]. `jax.lax.ragged_dot_general` contracts them in place.

Expert parallelism (models/sharding.py): a device holding experts [x0, x0 + E_local) of the
expert axis runs only their groups (`first_expert`): its rows are the sorted assignments of its
experts, moved to the front, the rest of the fixed-size buffer is a zero group; the layer's output
is then a partial sum, all-reduced by the caller with the tensor-parallel one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import gated
from models.quant import QuantizedWeight

_OUT_MAJOR = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_product(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [a, in] sorted by group, w [G, out, in] (out-major), group_sizes [G] -> [a, out] f32.
    Rows past sum(group_sizes) come out zero."""
    if isinstance(w, QuantizedWeight):
        return w.grouped_product(rows, group_sizes)
    rows = rows.astype(w.dtype)
    return jax.lax.ragged_dot_general(rows, w, group_sizes, _OUT_MAJOR,
                                      preferred_element_type=jnp.float32)


def route(logits: jax.Array, k: int, norm_topk_prob: bool):
    """Router logits [t, E] -> (weights [t, k] float32, expert ids [t, k] int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def moe_mlp(h: jax.Array, router_logits: jax.Array, gate_up, down, *, num_experts: int, k: int,
            norm_topk_prob: bool, act: str, first_expert=0, num_local_experts: int | None = None,
            record=None):
    """h [t, e] -> [t, e] float32. gate_up(rows, group_sizes) and down(rows, group_sizes) are the
    grouped products over this device's experts (the caller binds the weights: a plain call, or a
    lax.switch over layers). first_expert / num_local_experts: this device's slice of the experts
    (expert parallelism); by default all of them. record: called with the expert ids [t, k]
    (`load_callback`)."""
    t = h.shape[0]
    local = num_experts if num_local_experts is None else num_local_experts
    weights, ids = route(router_logits, k, norm_topk_prob)
    if record is not None:
        record(ids)
    flat = ids.reshape(-1)  # [a]
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    if local == num_experts:
        group_sizes, rows_order, row_weight = counts, order, weights.reshape(-1)[order]
    else:
        # Rows of this device's experts first: rotate the sorted assignments by their offset.
        starts = jnp.cumsum(counts) - counts
        offset = starts[first_expert]
        group_sizes = jax.lax.dynamic_slice(counts, (first_expert,), (local,))
        rows_order = jnp.roll(order, -offset)
        token_of = rows_order // k
        live = jnp.arange(flat.shape[0]) < jnp.sum(group_sizes)
        row_weight = jnp.where(live, weights.reshape(-1)[rows_order], 0.0)
    rows = h[token_of]
    y = down(gated(gate_up(rows, group_sizes), act), group_sizes) * row_weight[:, None]
    return jnp.zeros((t, y.shape[1]), jnp.float32).at[token_of].add(y)


class ExpertLoadRecorder:
    """The expert loads of every MoE layer of every step (experiments/bench/offline.py
    --expert_load): a step traced while a recorder is active (`with recorder:`) calls it back
    once per MoE layer with (layer index, assignments per expert over the step's real tokens,
    padding left out). Steps traced without one hold nothing of it: a dense model, or an MoE
    engine built outside the `with`, compiles and runs exactly as before. The recorder is read
    when a step is traced, so a function jitted and traced before keeps what it had. One device
    only (under tensor parallelism every device would report its copy)."""

    active: ExpertLoadRecorder | None = None

    def __init__(self):
        self.records: list[tuple[int, np.ndarray]] = []

    def __enter__(self) -> ExpertLoadRecorder:
        ExpertLoadRecorder.active = self
        return self

    def __exit__(self, *exc) -> None:
        ExpertLoadRecorder.active = None

    def _add(self, layer, counts) -> None:  # the host callback
        self.records.append((int(layer), np.asarray(counts)))

    def take(self) -> list[tuple[int, np.ndarray]]:
        """The (layer, counts [E]) recorded since the last take, in arrival order."""
        records, self.records = self.records, []
        return records


def load_callback(layer, num_tokens, num_experts: int, sharded: bool):
    """What `moe_mlp(record=...)` calls with the expert ids [t, k] when a recorder is active at
    trace time (None otherwise: nothing is added to the step). num_tokens: the real tokens (the
    first num_tokens rows; None: not a serving step, nothing recorded)."""
    recorder = ExpertLoadRecorder.active
    if recorder is None or num_tokens is None:
        return None
    if sharded:
        raise ValueError("ExpertLoadRecorder records a step on one device (tensor_parallel_size=1)")

    def record(ids):
        live = (jnp.arange(ids.shape[0]) < num_tokens).astype(jnp.int32)
        counts = jnp.bincount(ids.reshape(-1), weights=jnp.repeat(live, ids.shape[1]), length=num_experts)
        jax.debug.callback(recorder._add, jnp.asarray(layer, jnp.int32), counts.astype(jnp.int32))

    return record
