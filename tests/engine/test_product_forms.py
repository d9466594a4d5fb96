"""The CPU's float product forms chosen per row count (engine/step/product_forms.py): forced,
static, measured (timed on the served weights, kept on disk), and lowered as chosen."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, EngineConfig
from engine.step import product_forms
from models.layers import proj
from models.weight_first import product_forms as lowered_with


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * 0.1, dtype)  # noqa: E731
    return {"layers": [{"qkv_proj": w(48, 16), "o_proj": w(16, 16), "gate_up_proj": w(64, 16),
                        "down_proj": w(16, 32), "attn_norm": w(16)} for _ in range(2)],
            "embed": w(40, 16)}


def _weight_first_lowered(rows: int, dtype, table) -> bool:
    """Whether proj of `rows` rows lowers weight-first (its optimization barriers) under `table`."""
    x, w = jnp.ones((rows, 16), dtype), jnp.ones((24, 16), dtype)
    with lowered_with(table):
        text = jax.jit(lambda x, w: proj("te,ne->tn", x, w)).lower(x, w).as_text()
    return "optimization_barrier" in text


def test_the_table_being_lowered_overrides_the_static_rule_both_ways():
    assert _weight_first_lowered(8, jnp.float32, None)  # static: float32 from 2 rows
    assert not _weight_first_lowered(8, jnp.float32, {("float32", 8): False})
    assert _weight_first_lowered(8, jnp.float32, {("float32", 32): False})  # another row count
    assert not _weight_first_lowered(128, jnp.bfloat16, None)  # static: bfloat16 up to 64 rows
    assert _weight_first_lowered(128, jnp.bfloat16, {("bfloat16", 128): True})
    assert not _weight_first_lowered(1, jnp.float32, {("float32", 1): True})  # one row: never


def test_product_weights_are_the_layer_products_then_the_tied_lm_head():
    params = _params()
    got = product_forms.product_weights(params)
    assert [w.shape for w in got] == [(48, 16), (16, 16), (64, 16), (16, 32)] * 2 + [(40, 16)]
    assert product_forms.product_weights({**params, "lm_head": params["embed"].T})[-1].shape == (16, 32)
    assert product_forms.product_weights({"layers": {"qkv_proj": jnp.ones((2, 4, 4))}}) == []  # stacked


def test_forced_and_static_forms_and_a_bad_name():
    params, rows = _params(), [1, 2, 8, 256]
    assert product_forms.resolve("static", params, rows) is None
    assert product_forms.resolve("weight_first", params, rows) == {("float32", r): True for r in (2, 8, 256)}
    assert product_forms.resolve("plain", params, rows) == {("float32", r): False for r in (2, 8, 256)}
    with pytest.raises(ValueError, match="cpu_product_form must be one of .* got 'fastest'"):
        product_forms.resolve("fastest", params, rows)
    with pytest.raises(ValueError, match="EngineConfig.cpu_product_form must be one of"):
        EngineConfig(cpu_product_form="fastest")


def test_a_model_under_the_size_floor_keeps_the_static_rule(monkeypatch):
    monkeypatch.setattr(product_forms, "measure", lambda *a, **k: pytest.fail("measured a small model"))
    assert product_forms.resolve("measured", _params(), [2, 8]) is None


def test_measured_forms_take_the_faster_and_are_read_back_from_disk(tmp_path, monkeypatch):
    timings = {2: (1.0, 2.0), 8: (3.0, 2.0)}  # (weight-first, plain) ms
    options = []
    monkeypatch.setattr(product_forms, "measure",
                        lambda weights, rows, compiler_options=None: options.append(compiler_options) or timings[rows])
    monkeypatch.setattr(product_forms, "_SEEN", {})
    path = str(tmp_path / "product_forms.json")
    rows = [1, 2, 8, product_forms.MEASURE_MAX_ROWS * 2]
    want = {("float32", 2): True, ("float32", 8): False}  # past MEASURE_MAX_ROWS: the static rule
    assert product_forms.resolve("measured", _params(), rows, path=path, min_bytes=0) == want
    stored = json.load(open(path))
    assert sorted((e["rows"], e["weight_first"], e["plain_ms"]) for e in stored.values()) == [
        (2, True, 2.0), (8, False, 2.0)]
    # A restart (a new process: nothing seen yet) reads them instead of measuring again.
    monkeypatch.setattr(product_forms, "_SEEN", {})
    monkeypatch.setattr(product_forms, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert product_forms.resolve("measured", _params(), rows, path=path, min_bytes=0) == want
    # Chains compiled with other options (engine/step/cpu_compile.py) are measured afresh, with them.
    wide = {"xla_cpu_prefer_vector_width": 512}
    monkeypatch.setattr(product_forms, "measure",
                        lambda weights, rows, compiler_options=None: options.append(compiler_options) or timings[rows])
    assert product_forms.resolve("measured", _params(), rows, path=path, min_bytes=0,
                                 compiler_options=lambda rows: wide) == want
    assert options == [None, None, wide, wide] and len(json.load(open(path))) == 4
    # Other weights (another model) are measured afresh; a spent budget leaves them static.
    assert product_forms.resolve("measured", _params(jnp.bfloat16), rows, path=path, min_bytes=0,
                                 budget_seconds=-1.0) is None


def test_measure_times_both_chains_which_compute_the_same_products():
    weights = product_forms.product_weights(_params())
    first, plain = product_forms.measure(weights, 4, repeats=1)
    assert first > 0 and plain > 0
    xs = {i: jnp.full((4, i), 0.01, jnp.float32) for i in (16, 32)}
    np.testing.assert_allclose(product_forms._chain(True)(weights, xs), product_forms._chain(False)(weights, xs),
                               rtol=1e-5)


def test_an_engine_lowers_its_buckets_in_the_form_it_was_given():
    llm = LLM(model="random:tiny", cpu_product_form="plain", token_buckets=(1, 8), seq_buckets=(1, 8),
              max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, progress=False)
    runner = llm.engine.runner
    assert runner.product_forms == {("float32", 8): False}
    text = runner._lower(runner.shapes.all_buckets()[-1]).as_text()
    assert "optimization_barrier" not in text  # the static rule would run the 8-row products weight-first


def test_only_the_buckets_compiled_here_are_measured(monkeypatch):
    """Buckets loaded from saved executables (EngineConfig.load_executables) are not compiled, so
    their row counts are not measured."""
    from engine.core.builder import cpu_product_forms
    from engine.step.buckets import RunnerShapes

    shapes = RunnerShapes(token_buckets=(1, 8, 32), seq_buckets=(1, 8), max_blocks_per_seq=4, num_blocks=16,
                          block_size=16, num_logprobs=2, sample_vocab_size=40, prompt_scoring=False)
    asked = []
    monkeypatch.setattr(product_forms, "resolve", lambda form, params, rows, **k: asked.append(rows))
    buckets = shapes.all_buckets()
    cpu_product_forms(EngineConfig(), shapes)({})
    cpu_product_forms(EngineConfig(), shapes, {b: None for b in buckets if b.padded_tokens != 8})({})
    cpu_product_forms(EngineConfig(), shapes, {b: None for b in buckets})({})
    assert asked == [[1, 8, 32], [8], []]


def _int8_params():
    from models.quant import hold_code_sums, quantize_params

    return hold_code_sums(quantize_params(_params(), "int8", activation_rows=2))


def test_int8_weights_are_the_served_int8_products_that_quantize_their_activations():
    params = _int8_params()
    got = product_forms.int8_weights(params)
    assert [w.q.shape for w in got] == [(48, 16), (16, 16), (64, 16), (16, 32)] * 2 + [(40, 16)]
    assert all(w.code_sums is not None for w in got)
    assert product_forms.product_weights(params) == []  # no float products left
    assert product_forms.int8_weights(_params()) == []


def test_int8_forms_are_exact_and_lowered_as_the_table_says():
    from models.int8_dot import int8_product

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.integers(-127, 128, (24, 16), dtype=np.int8))
    sums = q.astype(jnp.int32).sum(1)
    for rows in (2, 8, 33):
        x = jnp.asarray(rng.integers(-127, 128, (rows, 16), dtype=np.int8))
        want = np.asarray(x, np.int64) @ np.asarray(q, np.int64).T
        for weight_first in (True, False):
            with lowered_with({("int8", rows): weight_first}):
                np.testing.assert_array_equal(jax.jit(int8_product)(x, q, sums), want)

    def lowered(table):
        x = jnp.ones((8, 16), jnp.int8)
        with lowered_with(table):
            return jax.jit(lambda x, q: int8_product(x, q, sums)).lower(x, q).as_text()

    assert "optimization_barrier" in lowered({("int8", 8): True})
    assert "optimization_barrier" not in lowered({("int8", 8): False})
    assert "optimization_barrier" not in lowered({("int8", 2): True})  # another row count
    assert "optimization_barrier" not in lowered(None)  # static: as before, xq . q^T


def test_int8_products_are_measured_only_under_measured_and_only_where_they_quantize(tmp_path, monkeypatch):
    params, rows = _int8_params(), [1, 2, 8, product_forms.MEASURE_MAX_ROWS * 2]
    monkeypatch.setattr(product_forms, "_SEEN", {})
    asked = []
    monkeypatch.setattr(product_forms, "measure", lambda weights, r, compiler_options=None: (
        asked.append((type(weights[0]).__name__, r)) or ((1.0, 2.0) if r == 2 else (3.0, 2.0))))
    path = str(tmp_path / "product_forms.json")
    got = product_forms.resolve("measured", params, rows, path=path, min_bytes=0)
    assert got == {("int8", 2): True, ("int8", 8): False}
    assert asked == [("QuantizedWeight", 2), ("QuantizedWeight", 8)]
    assert sorted(e["dtype"] for e in json.load(open(path)).values()) == ["int8", "int8"]
    for form in ("static", "plain", "weight_first"):  # the forced forms name float products only
        assert product_forms.resolve(form, params, rows, path=path, min_bytes=0) is None


def test_measure_times_both_int8_chains_which_compute_the_same_products():
    weights = product_forms.int8_weights(_int8_params())
    first, plain = product_forms.measure(weights, 4, repeats=1)
    assert first > 0 and plain > 0
    xs = {i: jnp.full((4, i), 0.01, jnp.float32) for i in (16, 32)}
    assert product_forms._chain(True)(weights, xs) == product_forms._chain(False)(weights, xs)
