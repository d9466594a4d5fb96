"""experiments/lab/op_profile.py: own times of nested trace events, ops classified from a compiled
module's HLO, and an engine's traced steps split by op class and source."""

import jax
import jax.numpy as jnp
import pytest

from experiments.lab.op_profile import HloIndex, OpProfile, self_times


def _event(op, ts, dur, tid=1):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": op,
            "args": {"hlo_module": "m", "hlo_op": op}}


def test_own_time_subtracts_the_ops_nested_inside():
    events = [_event("while.1", 0, 100), _event("fusion.2", 10, 30), _event("fusion.3", 50, 20),
              _event("copy.4", 120, 5), _event("fusion.2", 0, 7, tid=2)]
    times = self_times(events)
    assert times[("m", "while.1")] == pytest.approx(50)
    assert times[("m", "fusion.2")] == pytest.approx(37)  # both threads
    assert times[("m", "fusion.3")] == pytest.approx(20) and times[("m", "copy.4")] == pytest.approx(5)


def test_ops_are_classified_by_what_they_compute_and_where():
    def f(x, w, ids, n):
        y = jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)  # a device trip count: a while
        return y[ids].sum(axis=0)

    args = (jnp.ones((16, 16)), jnp.ones((16, 16)), jnp.array([0, 3, 5]), jnp.int32(3))
    index = HloIndex(jax.jit(f).lower(*args).compile().as_text())
    kinds = {kind for kind, _ in index.ops.values()}
    assert {"product", "control", "gather"} <= kinds, index.ops
    assert {where for _, where in index.ops.values()} <= {"other"}  # this file is not the engine's


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(model="random:tiny", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
               token_buckets=(4, 32), seq_buckets=(4,), compilation_cache_dir=None, progress=False)


def test_an_engine_s_steps_split_by_op_class(llm):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1 + (5 * i + j) % 200 for j in range(20)] for i in range(4)]
    llm.generate(prompts[:1], params, use_tqdm=False)
    with OpProfile(llm.engine) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    rows = prof.rows()
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    where = {r["where"] for r in rows}
    assert {"attention", "weights"} <= where, rows
    products = sum(r["ms"] for r in rows if r["kind"] == "product")
    assert products > 0
    assert "| where | kind | ms | share |" in prof.table()
