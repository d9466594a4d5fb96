"""EngineConfig.cpu_attention_kernel: how an engine's decode rows run on the CPU (the native
kernel, pallas_kernels/cpu_native.py, or the jnp page loop), resolved per platform and backend,
refused by name where it cannot run, lowered into every bucket, and serving the same tokens."""

import logging
import re

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.core import builder
from pallas_kernels import cpu_native


def test_the_choice_resolves_per_platform_and_is_refused_by_name(monkeypatch, caplog):
    config = lambda kernel: EngineConfig(model="random:tiny", cpu_attention_kernel=kernel)  # noqa: E731
    with pytest.raises(ValueError, match="cpu_attention_kernel must be one of auto, native, jnp"):
        config("fast")
    assert builder.rows_kernel(config("auto"), "cpu", "xla") == "native"  # built here (the suite needs it)
    assert builder.rows_kernel(config("native"), "cpu", "xla") == "native"
    assert builder.rows_kernel(config("jnp"), "cpu", "xla") == "jnp"
    assert builder.rows_kernel(config("auto"), "tpu", "pallas_tpu") == "jnp"
    assert builder.rows_kernel(config("auto"), "cpu", "pallas_gpu") == "jnp"  # interpret mode
    with pytest.raises(ValueError, match="'native' runs on the CPU's xla attention path; this engine runs "
                                         "'pallas_tpu' on 'tpu'"):
        builder.rows_kernel(config("native"), "tpu", "pallas_tpu")
    # Where it cannot be built: "auto" warns and runs the page loop, "native" is an error.
    monkeypatch.setattr(cpu_native, "_library", lambda: (None, "NativeUnavailable: no C++ compiler"))
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        assert builder.rows_kernel(config("auto"), "cpu", "xla") == "jnp"
    assert "unavailable (NativeUnavailable: no C++ compiler)" in caplog.text
    with pytest.raises(ValueError, match=re.escape("cpu_attention_kernel='native': NativeUnavailable: no C++ compiler")):
        builder.rows_kernel(config("native"), "cpu", "xla")


def test_manifests_name_the_native_kernel_only_when_it_is_on():
    from engine.step.buckets import RunnerShapes
    from engine.step.executables import manifest
    from models.config import preset_config

    shapes = RunnerShapes(token_buckets=(8,), seq_buckets=(8,), num_blocks=16, block_size=16, max_blocks_per_seq=4,
                          num_logprobs=0, sample_vocab_size=256)
    meta = lambda kernel: manifest(platform="cpu", device_kind="cpu", model=preset_config("tiny"), dtype="float32",  # noqa: E731
                                   attention_backend="xla", layer_loop="switch", tensor_parallel_size=1,
                                   shapes=shapes, rows_kernel=kernel)["knobs"]
    assert meta("native")["rows_kernel"] == "native"
    assert "rows_kernel" not in meta("jnp")  # manifests written before the kernel stay valid


@pytest.fixture(scope="module")
def engines():
    options = dict(model="random:tiny", token_buckets=(8,), seq_buckets=(8,), max_num_seqs=8,
                   max_num_batched_tokens=8, max_model_len=128, prompt_scoring_bucket=False, progress=False)
    return {kernel: LLM(cpu_attention_kernel=kernel, **options) for kernel in ("native", "jnp")}


def test_every_bucket_lowers_the_kernel_and_serves_the_page_loops_tokens(engines):
    texts = {kernel: [c.as_text() for c in llm.engine.runner._compiled.values()] for kernel, llm in engines.items()}
    assert texts["native"] and all(cpu_native.TARGET in t for t in texts["native"])
    assert not any(cpu_native.TARGET in t for t in texts["jnp"])
    prompts = ["hello there", "a longer prompt of a few more words than that", "x", "count: 1 2 3 4"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {kernel: [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
              for kernel, llm in engines.items()}
    assert [len(t) for t in tokens["native"]] == [24] * len(prompts)
    assert tokens["native"] == tokens["jnp"]
