"""The CPU's compile options (engine/step/cpu_compile.py): the vector width XLA:CPU's loops
prefer, resolved from EngineConfig.cpu_vector_width, taken by XLA, and given to every compile of
an engine's steps."""

import glob

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, EngineConfig
from engine.core.builder import compiler_options
from engine.step import cpu_compile


def test_widths_resolve_per_row_count_and_a_bad_one_is_refused(monkeypatch):
    wide, narrow = {"xla_cpu_prefer_vector_width": 512}, {"xla_cpu_prefer_vector_width": 256}
    assert [cpu_compile.compiler_options("256", r) for r in (1, 8)] == [narrow, narrow]
    assert [cpu_compile.compiler_options("512", r) for r in (1, 8)] == [wide, wide]
    monkeypatch.setattr(cpu_compile, "has_avx512", lambda: True)
    assert [cpu_compile.compiler_options("auto", r) for r in (1, 2, 8, 256)] == [wide, None, None, None]
    monkeypatch.setattr(cpu_compile, "has_avx512", lambda: False)
    assert cpu_compile.compiler_options("auto", 1) is None  # XLA's default
    with pytest.raises(ValueError, match="cpu_vector_width must be one of auto, 256, 512; got '1024'"):
        cpu_compile.compiler_options("1024", 1)
    with pytest.raises(ValueError, match="EngineConfig.cpu_vector_width must be one of auto, 256, 512, got '128'"):
        EngineConfig(cpu_vector_width="128")
    assert EngineConfig(cpu_vector_width=512).cpu_vector_width == "512"  # a number is taken as its name
    with pytest.raises(ValueError, match="cpu_vector_width"):
        EngineConfig(cpu_vector_width=True)
    # Other platforms get no option from it; the CPU's by a program's token rows.
    assert compiler_options(EngineConfig(cpu_vector_width="512"), "tpu") is None
    assert compiler_options(EngineConfig(cpu_vector_width="512"), "cpu")(8) == wide


@pytest.mark.parametrize("width", [256, 512])
def test_xla_compiles_its_loops_for_the_width_given(tmp_path, width):
    """The one-row int8 weight-only product (an XLA:CPU loop, models/quant.py) compiled with the
    option: its LLVM function says the width asked for."""
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, (96, 64), dtype=np.int8))
    x = jnp.ones((1, 64), jnp.float32)
    product = jax.jit(lambda x, q: jnp.dot(x, q.T.astype(jnp.float32), preferred_element_type=jnp.float32))
    options = {**cpu_compile.compiler_options(str(width), 1), "xla_dump_to": str(tmp_path)}
    compiled = product.lower(x, q).compile(options)
    np.testing.assert_allclose(compiled(x, q), x @ q.T.astype(jnp.float32), rtol=1e-6)
    ir = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*ir-with-opt.ll")))
    assert f'"prefer-vector-width"="{width}"' in ir


@pytest.mark.parametrize("width", ["auto", "512"])
def test_an_engine_compiles_every_bucket_with_its_options(monkeypatch, width):
    from engine import SamplingParams
    from engine.step.model_runner import ModelRunner

    monkeypatch.setattr(cpu_compile, "has_avx512", lambda: True)
    given = {}
    lower = ModelRunner._lower

    class Spy:
        def __init__(self, lowered, bucket):
            self.lowered, self.bucket = lowered, bucket

        def compile(self, options=None):
            given[self.bucket.padded_tokens] = options
            return self.lowered.compile(options)

    monkeypatch.setattr(ModelRunner, "_lower", lambda self, bucket: Spy(lower(self, bucket), bucket))
    llm = LLM(model="random:tiny", cpu_vector_width=width, token_buckets=(1, 8), seq_buckets=(1, 8),
              max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, progress=False)
    wide = {"xla_cpu_prefer_vector_width": 512}
    assert given == {1: wide, 8: wide if width == "512" else None}
    out = llm.generate(["hello", "a longer prompt of a few words"], SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
