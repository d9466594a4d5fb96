"""The runner's fixed shapes: declared buckets only, the cache donated in place, and the
persistent compilation cache reused by a second start."""

import os
import subprocess
import sys
import textwrap

import pytest

from engine.step.buckets import Bucket, default_buckets


def test_buckets_are_declared_and_a_shape_outside_is_an_error(engine):
    shapes = engine.runner.shapes
    assert shapes.buckets() == [Bucket(1, 8, 1), Bucket(8, 8, 8), Bucket(32, 32, 32), Bucket(128, 32, 32)]
    # The largest token bucket again with a logit row per token, for steps that score a prompt.
    assert shapes.scoring_bucket == Bucket(128, 32, 128) and shapes.all_buckets()[-1] == shapes.scoring_bucket
    assert set(engine.runner._compiled) == set(shapes.all_buckets())  # all compiled at start-up
    assert shapes.bucket_for(1, 1) == Bucket(1, 8, 1) and shapes.bucket_for(3, 2) == Bucket(8, 8, 8)
    assert shapes.bucket_for(17, 8) == Bucket(32, 32, 32)
    assert shapes.bucket_for(8, 9) == Bucket(32, 32, 32)  # 9 rows: past the 8-row bucket
    with pytest.raises(ValueError, match="token bucket"):
        shapes.bucket_for(129, 1)
    assert shapes.bucket_for(8, 2, num_logits=33) == Bucket(128, 32, 128)  # a scored chunk
    with pytest.raises(ValueError, match="sampled positions"):
        shapes.bucket_for(8, 2, num_logits=129)
    with pytest.raises(ValueError, match="not a declared bucket"):
        engine.runner._executable(Bucket(64, 8, 8))
    assert default_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert default_buckets(2048)[-3:] == (1536, 1792, 2048)


def test_kv_cache_is_donated_and_aliased_in_place(engine):
    hlo = engine.runner._compiled[Bucket(8, 8, 8)].as_text()
    # The stacked K and V caches and the request table's arrays alias outputs: the step writes
    # the donated buffers in place (2 caches + 10 table arrays).
    num_aliases = hlo.count("may-alias") + hlo.count("must-alias")
    assert num_aliases >= 2 + 10, hlo[:2000]


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_second_start_reuses_the_persistent_compilation_cache(tmp_path):
    """Two engines built one after the other in a fresh process, jax's in-memory caches cleared
    between them: the first compiles and writes the cache, the second reads every bucket back."""
    script = textwrap.dedent("""
        import jax, sys
        hits = [0]
        def listen(event, **kw):
            if event == "/jax/compilation_cache/cache_hits":
                hits[0] += 1
        jax.monitoring.register_event_listener(listen)
        from engine.config import EngineConfig
        from engine.core.llm_engine import LLMEngine
        for start in ("FIRST", "SECOND"):
            jax.clear_caches()
            before = hits[0]
            LLMEngine(EngineConfig(model="random:tiny", max_num_seqs=2, max_num_batched_tokens=16,
                                   max_model_len=64, token_buckets=(4, 16), seq_buckets=(2,),
                                   compilation_cache_dir=sys.argv[1]), progress=False)
            print(start, hits[0] - before)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAXSERVE_COMPILATION_CACHE", None)
    cache = str(tmp_path / "jax-cache")
    r = subprocess.run([sys.executable, "-c", script, cache], capture_output=True, text=True, env=env,
                       timeout=300, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr[-2000:]
    counts = dict(line.split() for line in r.stdout.splitlines() if line.startswith(("FIRST", "SECOND")))
    assert os.listdir(cache)
    assert int(counts["FIRST"]) == 0 and int(counts["SECOND"]) >= 2, r.stdout  # both buckets from the cache


def test_background_compile_serves_at_once_in_compiled_buckets_then_compiles_the_rest(tiny_engine):
    """background_compile: the smallest and largest buckets (and the scoring one) compile at
    start-up; until another bucket is ready its steps pad into the next compiled one, and the
    tokens are the same."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.engine.conftest import TINY_KNOBS, run_to_completion

    shapes = tiny_engine.runner.shapes
    first, *middle, last = shapes.buckets()
    ready = {first, last, shapes.scoring_bucket}.__contains__
    assert shapes.bucket_for(1, 1, ready=ready) == first
    assert shapes.bucket_for(2, 2, ready=ready) == last  # 4 and 16 not ready: padded to 64
    assert shapes.bucket_for(2, 2, ready=lambda b: b != middle[0]) == middle[1]

    engine = LLMEngine(EngineConfig(**TINY_KNOBS, background_compile=True), progress=False)
    assert {first, last, shapes.scoring_bucket} <= set(engine.runner._compiled)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [(f"bg{i}", f"prompt {i} " * (i + 1), greedy) for i in range(6)]
    got = run_to_completion(engine, requests)  # while the other buckets may still compile
    assert engine.runner.wait_compiled(timeout=300)
    assert set(engine.runner._compiled) == set(shapes.all_buckets())
    want = run_to_completion(tiny_engine, requests)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_exit_while_buckets_compile_in_the_background_is_clean(tmp_path):
    """A process that ends while the background thread is inside an XLA compile exits 0: at exit
    the thread stops after its current bucket (a daemon thread killed mid-compile aborted the
    process with "FATAL: exception not rethrown", e.g. `make serve` stopped in its first seconds)."""
    script = textwrap.dedent("""
        from engine.config import EngineConfig
        from engine.core.llm_engine import LLMEngine
        from tests.engine.conftest import TINY_KNOBS

        # The default model's shapes: tiny's compiles end too fast to be caught in one.
        knobs = dict(TINY_KNOBS, model="random:smollm2-135m", token_buckets=(1, 4, 64), seq_buckets=(4,),
                     max_num_seqs=4, num_kv_blocks=64, background_compile=True,
                     prompt_scoring_bucket=False)
        engine = LLMEngine(EngineConfig(**knobs), progress=False)
        print("BUILT", engine.runner.all_compiled, flush=True)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                       cwd=os.getcwd())
    assert "BUILT False" in r.stdout, (r.stdout, r.stderr[-2000:])  # it exited with buckets left to compile
    assert r.returncode == 0 and "Fatal Python error" not in r.stderr, r.stderr[-2000:]
