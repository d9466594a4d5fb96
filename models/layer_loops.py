"""How the decoder (models/llama.py) loops over its layers, beside a plain Python loop (unrolled)
and a lax.scan over stacked weights: the switch scan, a lax.scan over groups of `layer_period`
layers whose weight products are lax.switch branches over each layer's own out-major buffers
(the CPU's layout, DESIGN.md section 7; float32 and small bfloat16 ones run weight-first there, models/weight_first.py), and the layer indices a group scan hands the layer
step (`Static`: traced for the cache, static modulo the period for the layer's kind).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import proj
from models.moe import grouped_product

# The served layout's products, as the lax.switch branches of `switch_scan` run them.
SERVED_PRODUCTS = {"qkv_proj": "te,ne->tn", "o_proj": "tn,en->te", "gate_up_proj": "te,ne->tn",
                   "down_proj": "tf,ef->te", "router": "te,ne->tn"}
GROUPED_PRODUCTS = ("experts_gate_up", "experts_down")  # (rows, group_sizes) -> rows' outputs


def served_product(name: str, *args, w):
    if name in GROUPED_PRODUCTS:
        rows, group_sizes = args
        return grouped_product(rows, w, group_sizes)
    return proj(SERVED_PRODUCTS[name], *args, w)


class Static(int):
    """A layer index inside a group scan: traced (`value`) for the cache, static modulo p."""

    def __new__(cls, traced, position: int):
        obj = super().__new__(cls, position)
        obj.traced = traced
        return obj


def layer_index(index):  # the cache's layer index (traced in a scan)
    return index.traced if isinstance(index, Static) else index


def rank_in_kind(config: ModelConfig, index, kind: str):
    """A layer's index in its kind's cache group (a two-group cache, engine/step/kv_cache.py): the
    layers of its kind before it. In a group scan (index a Static: traced g * p + j, static j) that
    is g times the kind's layers per period plus those before position j."""
    kinds = config.layer_kinds
    if isinstance(index, Static):
        period = kinds[: config.layer_period]
        return (index.traced // len(period) * period.count(kind)
                + period[: int(index)].count(kind))
    return kinds[:index].count(kind)


def switch_scan(x, cache, layers: list, period: int, step):
    """The layers as a lax.scan over groups of `period` layers, each layer's weights in its own
    buffers.

    Each weight product is a lax.switch over one branch per layer holding that product alone,
    so every branch reads its layer's matrix in place (a scan over stacked weights slices each
    layer's out, a copy XLA:CPU makes before every dot) and the branches are library calls,
    cheap to compile; the norms, RoPE, attention, cache writes and activations are in the body,
    compiled once per position of the group, with the layer's norm weights and bias (small)
    stacked and indexed. The tensor-parallel all-reduces stay outside the branches. Layers past
    the last whole group run after the scan. Served layout only."""
    products = [name for name in (*SERVED_PRODUCTS, *GROUPED_PRODUCTS) if name in layers[0]]
    if "qkv_proj" not in products or "o_proj" not in products:
        raise ValueError("the switch layer scan runs the served layout (models/served_layout.py "
                         f"fuse_projections); got layer weights {sorted(layers[0])}")
    branches = {name: [functools.partial(served_product, name, w=layer[name]) for layer in layers]
                for name in products}
    small = {name: jnp.stack([layer[name] for layer in layers])
             for name in layers[0] if name not in products}
    n = len(layers)
    full = n - n % period
    local = layers[0]["experts_gate_up"].shape[0] if "experts_gate_up" in layers[0] else None

    def run(carry, index, position):
        product = lambda name, *a: jax.lax.switch(index, branches[name], *a)  # noqa: E731
        rows = {name: a[index] for name, a in small.items()}
        if local is not None:
            rows["experts_local"] = local
        model_index = Static(index, position) if not isinstance(index, int) else index
        return step(carry, rows, product, model_index)

    def body(carry, g):
        for j in range(period):
            carry = run(carry, g * period + j, j)
        return carry, None

    carry = (x, cache)
    if full:
        carry, _ = jax.lax.scan(body, carry, jnp.arange(full // period, dtype=jnp.int32))
    for index in range(full, n):
        carry = run(carry, index, index % period)
    return carry
