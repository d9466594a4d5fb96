"""Expert loads read from the paged step (models/moe.ExpertLoadRecorder) and their summary
(experiments/bench/expert_load.py, bench_offline --expert_load)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench.expert_load import imbalance, step_loads, summarize
from models.config import preset_config
from models.llama import forward_paged
from models.moe import ExpertLoadRecorder, grouped_product, load_callback, moe_mlp
from models.random_weights import random_params
from models.served_layout import fuse_projections
from tests.models.paged_batch import make_batch

pytestmark = pytest.mark.usefixtures("fast_compile")

CONFIG = preset_config("tiny-mixtral")  # 2 layers, 4 experts, top-2
BLOCK = 8


def _step_inputs(rng):
    chunks = [(rng.integers(0, CONFIG.vocab_size, 7).tolist(), 0), (rng.integers(0, CONFIG.vocab_size, 3).tolist(), 0)]
    return make_batch(chunks, [[1], [2]], BLOCK, pad_tokens=6, pad_seqs=2, max_blocks=2)  # 10 real of 16


def test_a_step_traced_under_a_recorder_reports_each_layers_loads_over_real_tokens():
    params = fuse_projections(random_params(CONFIG, seed=2))
    cache = (jnp.zeros((CONFIG.num_layers, 4, BLOCK, CONFIG.num_kv_heads, CONFIG.head_dim)),) * 2
    batch = _step_inputs(np.random.default_rng(0))

    def step():  # a new function each time: the recorder is read when a step is traced
        return jax.jit(lambda p, c, b: forward_paged(p, CONFIG, c, b, scan_layers=True)[1])

    plain = step().lower(params, cache, batch)
    with ExpertLoadRecorder() as recorder:
        logits = step()(params, cache, batch)
        records = recorder.take()
    assert "callback" not in plain.as_text()  # a step traced without a recorder has nothing of it
    np.testing.assert_array_equal(logits, plain.compile()(params, cache, batch))  # the math unchanged
    (loads,) = step_loads(records, CONFIG.num_layers)
    assert loads.shape == (2, 4) and (loads.sum(axis=1) == 10 * 2).all()  # padding left out
    assert ExpertLoadRecorder.active is None


def test_the_counts_are_the_top_k_choices_of_the_live_rows():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32)  # [E, 2f, e], f = 4
    down = jnp.asarray(rng.standard_normal((4, 8, 4)), jnp.float32)  # [E, e, f]

    def mlp(h, logits, record=None):
        return moe_mlp(h, logits, lambda rows, sizes: grouped_product(rows, gate_up, sizes),
                       lambda rows, sizes: grouped_product(rows, down, sizes), num_experts=4, k=2,
                       norm_topk_prob=True, act="silu", record=record)

    with ExpertLoadRecorder() as recorder:
        out = jax.jit(lambda h, lg: mlp(h, lg, load_callback(3, jnp.int32(5), 4, sharded=False)))(h, logits)
        (layer, counts), = recorder.take()
    top2 = np.argsort(-np.asarray(logits)[:5], axis=1)[:, :2]  # the 5 live rows' choices
    assert layer == 3 and counts.tolist() == np.bincount(top2.ravel(), minlength=4).tolist()
    np.testing.assert_array_equal(out, jax.jit(mlp)(h, logits))


def test_load_callback_is_none_without_a_recorder_or_outside_a_serving_step():
    assert load_callback(0, jnp.int32(3), 4, sharded=False) is None
    with ExpertLoadRecorder():
        assert load_callback(0, None, 4, sharded=False) is None  # forward_dense
        with pytest.raises(ValueError, match="one device"):
            load_callback(0, jnp.int32(3), 4, sharded=True)


def test_summary_of_known_loads():
    even = np.array([[2, 2, 2, 2], [2, 2, 2, 2]])  # 4 tokens, top-2, 4 experts
    skewed = np.array([[4, 4, 0, 0], [3, 1, 2, 2]])
    assert imbalance(even).tolist() == [1.0, 1.0]
    assert imbalance(skewed).tolist() == [2.0, 1.5]
    lone = np.array([[1, 1, 0, 0], [0, 1, 1, 0]])  # one token: 2 is the most even it can be
    summary = summarize([even, skewed, lone, np.zeros((2, 4), int)], k=2)  # an empty step is dropped
    assert summary["steps"] == 3 and summary["tokens_per_step_median"] == 4
    assert summary["imbalance_max"] == 2.0 and summary["imbalance_max_full_steps"] == 1.75
    assert summary["worst_layer_max"] == 2.0 and summary["even_floor_median"] == 1.0
    assert summary["run_imbalance"] == pytest.approx(np.mean([7 / 4.5, 5 / 4.5]))  # summed loads
    with pytest.raises(ValueError, match="layers"):
        step_loads([(0, even[0]), (0, even[1])], 2)
