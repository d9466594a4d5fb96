"""Paged prefill in chunks, then decode, for several sequences at once, equals the dense oracle,
with the layer loop unrolled and as a lax.scan over stacked layers, and with the runner's fused
q/k/v and gate/up projections (the oracle keeps the loaders' separate layout)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import preset_config
from models.llama import forward_dense, forward_paged
from models.random_weights import random_params
from models.served_layout import fuse_projections, stack_layers
from tests.models.paged_batch import make_batch

pytestmark = pytest.mark.usefixtures("fast_compile")  # random tiny shapes: -O0 (tests/conftest.py)

BLOCK_SIZE = 16
NUM_BLOCKS = 64


def _config(num_heads, num_kv_heads, **extra):
    base = preset_config("tiny")
    return dataclasses.replace(base, num_heads=num_heads, num_kv_heads=num_kv_heads, **extra)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,extra",
    [(4, 4, {}), (6, 2, {}), (8, 2, {}), (4, 4, {"architecture": "qwen2", "attention_bias": True,
                                                 "tie_word_embeddings": False})],
    ids=["gqa1", "gqa3", "gqa4", "qwen2-bias-untied"],
)
def test_chunked_prefill_then_decode_matches_dense(num_heads, num_kv_heads, extra):
    # The CPU engine's layout: served (fused, out-major) weights, per-layer buffers under a
    # lax.switch scan (engine/config.py resolve_layer_loop).
    _check_against_dense(_config(num_heads, num_kv_heads, **extra), "switch", True)


# The other layouts (the loaders' separate projections, the unrolled layer loop) on one GQA config:
# every layout shares the model code, so one config is enough to catch a layout's own mistake.
@pytest.mark.parametrize("loop,fused", [("unrolled", False), ("stacked", False), ("unrolled", True),
                                        ("stacked", True)],
                         ids=["unrolled", "stacked", "unrolled-fused", "stacked-fused"])
def test_other_layouts_match_dense(loop, fused):
    _check_against_dense(_config(6, 2), loop, fused)


def test_bfloat16_switch_scan_matches_the_bfloat16_dense_forward():
    """The CPU engine's bfloat16 path (served layout, switch scan, a bfloat16 cache) against the
    dense forward over the same bfloat16 weights: the same roundings (q, k, v to the cache's
    dtype, every product's inputs to bfloat16 with float32 accumulation), summed in another
    order: a bfloat16-sized tolerance (logits up to about 20 here, 3 significant digits)."""
    _check_against_dense(_config(6, 2), "switch", True, dtype=jnp.bfloat16, tol=0.1)


LENGTHS = (37, 16, 5, 50)  # partial last blocks, an exact block, a short one
DECODE_STEPS = 4
# Every step (prefill chunks of up to 20 tokens for 4 sequences, then decodes) padded to one
# shape, so each layout compiles once; padding tokens point into the null block.
STEP_TOKENS, STEP_SEQS = 84, 6
ORACLE_LEN = 64
_ORACLE: dict = {}


def _dense_logits(config, params, seqs):
    """Dense logits at every position of each whole sequence (causal: position p's logits are
    those of the prefix ending at p), computed once per config and dtype, shared by the layouts."""
    key = (repr(config), params["embed"].dtype.name)
    if key not in _ORACLE:
        forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
        # One padded length (one compile): causal, so padding after the end changes nothing.
        padded = [np.pad(np.asarray(s, np.int32), (0, ORACLE_LEN - len(s))) for s in seqs]
        _ORACLE[key] = [np.asarray(forward(params, jnp.asarray(x)))[: len(s)] for x, s in zip(padded, seqs)]
    return _ORACLE[key]


def _check_against_dense(config, loop, fused, dtype=jnp.float32, tol=1e-5):
    params = dense_params = jax.tree.map(lambda a: jnp.asarray(a, dtype), random_params(config, seed=1))
    rng = np.random.default_rng(0)
    lengths = list(LENGTHS)
    seqs = [rng.integers(0, config.vocab_size, n + DECODE_STEPS).tolist() for n in lengths]
    oracle = _dense_logits(config, dense_params, seqs)
    tables, next_block = [], 1
    for s in seqs:
        n = -(-len(s) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = (jnp.zeros((config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads,
                        config.head_dim), dtype),) * 2
    if loop == "stacked":
        params = stack_layers(params)
    if fused:
        params = fuse_projections(params)
        assert "qkv_proj" in (params["layers"] if loop == "stacked" else params["layers"][0])
    step = jax.jit(lambda p, c, b: forward_paged(p, config, c, b, scan_layers=loop != "unrolled"))
    # Prefill each prompt in chunks of up to 20 tokens, all sequences in one ragged batch per step.
    done = [0] * len(seqs)
    last_logits = [None] * len(seqs)
    chunk = 20
    while any(done[i] < lengths[i] for i in range(len(seqs))):
        active = [i for i in range(len(seqs)) if done[i] < lengths[i]]
        chunks = [(seqs[i][done[i] : min(lengths[i], done[i] + chunk)], done[i]) for i in active]
        batch = make_batch(chunks, [tables[i] for i in active], BLOCK_SIZE,
                           pad_tokens=STEP_TOKENS - sum(len(c[0]) for c in chunks),
                           pad_seqs=STEP_SEQS - len(active), max_blocks=8)
        cache, logits = step(params, cache, batch)
        for row, i in enumerate(active):
            done[i] += len(chunks[row][0])
            last_logits[i] = logits[row]
    for i in range(len(seqs)):
        np.testing.assert_allclose(last_logits[i], oracle[i][lengths[i] - 1], atol=tol, rtol=tol)
    # Four decode steps for all sequences together.
    for extra_token in range(DECODE_STEPS):
        chunks = [(s[lengths[i] + extra_token : lengths[i] + extra_token + 1], lengths[i] + extra_token)
                  for i, s in enumerate(seqs)]
        batch = make_batch(chunks, tables, BLOCK_SIZE, pad_tokens=STEP_TOKENS - len(seqs),
                           pad_seqs=STEP_SEQS - len(seqs), max_blocks=8)
        cache, logits = step(params, cache, batch)
        for i in range(len(seqs)):
            np.testing.assert_allclose(logits[i], oracle[i][lengths[i] + extra_token], atol=tol,
                                       rtol=tol)
    # The null block (0) may hold padding garbage, but no live block was written by padding:
    # re-running the dense check above already proves the live blocks are intact.
