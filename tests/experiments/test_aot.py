"""experiments.aot: the engine's step programs compiled for a target from abstract weights.

On the CPU target (every run): the programs are the ones the runner compiles (same buckets,
the request table and cache donated), the bytes per device come from the abstract state, the
collectives of tensor parallelism are read from the HLO, a configuration that does not fit says
so. Under the `aot` marker (`make aot-test`, with the device compilers of `make aot-setup`): a
small model's whole step compiled for a TPU topology at tensor parallel 2 and for a GPU target,
with quantized weights and an 8-bit cache on both (bytes equal to the calculator's), and the
JSON report's keys.
"""

import json
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig
from experiments import aot
from experiments.lab.aot_build import compile_for_target
from experiments.lab.aot_results import count_collectives
from models.config import preset_config

TINY = preset_config("tiny")
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=8, token_buckets=(4, 8), seq_buckets=(4,),
             max_model_len=128)


@pytest.fixture(scope="module")
def cpu_tp2():
    config = EngineConfig(model="random:tiny", tensor_parallel_size=2, **SMALL)
    return config, compile_for_target(config, TINY, "cpu", progress=None)


def test_cpu_target_builds_every_bucket_with_the_engines_shapes(cpu_tp2):
    config, build = cpu_tp2
    # The plain buckets, then the scoring bucket (the largest with a logit row per token).
    assert [(b.padded_tokens, b.padded_seqs, b.padded_logits) for b in build.buckets] == [
        (4, 4, 4), (8, 4, 4), (8, 4, 8)]
    assert all(b.compile_s > 0 for b in build.buckets)
    # The KV cache as the engine sizes it on the CPU: its byte budget, capped at what it can use.
    assert build.num_blocks == 4 * (128 // 16) + 1
    per_token = TINY.kv_bytes_per_token(4) // 2  # float32, split over 2 devices on KV heads
    assert build.kv_bytes_per_block == per_token * 16
    assert build.kv_cache_bytes == build.num_blocks * build.kv_bytes_per_block
    assert build.weights_bytes > 0 and build.fits


def test_tensor_parallel_collectives_are_the_megatron_pattern(cpu_tp2):
    _, build = cpu_tp2
    for bucket in build.buckets:  # two all-reduces a layer (after o_proj and down_proj)
        assert bucket.collectives_per_layer["all-reduce"] == 2, bucket.collectives_per_layer


def test_report_keys_and_the_capacity_figures(cpu_tp2):
    config, build = cpu_tp2
    r = aot.report(build, TINY, config)
    assert r["fits"] is True and r["hbm_bytes"] > 0
    assert set(r["per_device_bytes"]) >= {"weights", "kv_cache", "temp", "total"}
    d = r["per_device_bytes"]
    assert d["total"] == d["weights"] + d["kv_cache"] + d["request_table"] + d["temp"]
    assert r["max_kv_tokens"] >= r["kv_tokens"]
    assert [set(b) >= {"compile_s", "padded_tokens"} for b in r["buckets"]] == [True] * 3
    json.dumps(r)  # serializable
    assert "FITS" in aot.format_report(r)


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_a_configuration_that_does_not_fit_is_a_report():
    config = EngineConfig(model="random:tiny", num_kv_blocks=2**22, **SMALL)  # 32 GiB of KV
    build = compile_for_target(config, TINY, "cpu", progress=None)
    assert not build.fits and build.total_bytes > build.usable_bytes
    assert "DOES NOT FIT" in aot.format_report(aot.report(build, TINY, config))


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_disaggregation_compiles_the_kv_gather_and_scatter():
    config = EngineConfig(model="random:tiny", disaggregation="prefill:1,decode:1", **SMALL)
    build = compile_for_target(config, TINY, "cpu", progress=None)
    programs = [(t["program"], t["blocks"]) for t in build.transfers]
    # Block buckets up to the longest request's 8 blocks, each gathered and scattered.
    assert programs == [(p, n) for n in (1, 2, 4, 8) for p in ("gather", "scatter")]
    assert "gather 8" in aot.format_report(aot.report(build, TINY, config))


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_quantized_weights_and_an_int8_cache_compile_at_tp2():
    """int8 weights (scales split with each weight's output dim, models/sharded_quant.py) and an
    int8 cache split on KV heads, values and scales: the Megatron pattern, the 8-bit bytes."""
    knobs = dict(SMALL, token_buckets=(8,), prompt_scoring_bucket=False)
    config = EngineConfig(model="random:tiny", tensor_parallel_size=2, quantization="int8",
                          kv_cache_dtype="int8", **knobs)
    build = compile_for_target(config, TINY, "cpu", progress=None)
    assert [b.collectives_per_layer["all-reduce"] for b in build.buckets] == [2]
    # per device: 16 tokens x K and V x 2 layers x 1 of 2 KV heads x (16 values + a 2-byte scale)
    assert build.kv_bytes_per_block == 16 * 2 * 2 * 1 * (16 + 2)
    assert build.weights_bytes < 0.3 * TINY.num_params * 4 / 2 and build.fits
    r = aot.report(build, TINY, config)
    assert (r["quantization"], r["kv_cache_dtype"]) == ("int8", "int8")


def test_collective_counting_reads_loop_bodies():
    hlo = "\n".join([
        "%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
        "  %a = f32[4]{0} all-reduce(%x), to_apply=%add",
        "  %b = f32[4]{0} all-reduce-start(%y), to_apply=%add",
        "}",
        "ENTRY %main (x: f32[4]) -> f32[8] {",
        "  %w = (s32[], f32[4]) while(%t), condition=%cond.1, body=%body.1",
        "  %g = f32[8]{0} all-gather(%x), dimensions={0}",
        "}",
    ])
    inside, outside = count_collectives(hlo)
    assert inside["all-reduce"] == 2 and outside == {**outside, "all-gather": 1, "all-reduce": 0}


def test_cache_copies_are_read_from_the_program_and_grow_with_the_pool():
    """cache_copy_bytes counts the copies whose result has a cache array's per-device shape (the
    layout suffix and other shapes ignored); Build.max_kv_blocks then charges them per block."""
    import jax
    import numpy as np

    from experiments.lab.aot_results import Build, cache_copy_bytes

    kv = (jax.ShapeDtypeStruct((2, 64, 16, 3, 8), np.dtype("bfloat16")),
          jax.ShapeDtypeStruct((2, 64, 16, 3), np.uint16))
    hlo = "\n".join([
        "  %c.1 = bf16[2,64,16,3,8]{1,4,3,2,0:T(8,128)(2,1)} copy(%kv_cache_0_.1), backend_config={}",
        "  %c.2 = u16[2,64,16,3]{3,2,1,0:T(8,128)} copy(%p), metadata={}",
        "  %c.3 = bf16[2,64,16,3,8]{4,3,2,1,0} fusion(%x), kind=kLoop",  # not a copy
        "  %c.4 = f32[16,3,8]{2,1,0} copy(%y)",  # not the cache's shape
    ])
    assert cache_copy_bytes(hlo, kv) == 2 * 64 * 16 * 3 * 8 * 2 + 2 * 64 * 16 * 3 * 2
    mib = 2**20
    build = Build("v5e-1", "tpu", "bfloat16", "pallas_tpu", "scan", 1, 128, 16, 100, 100 * mib, 90 * mib,
                  10 * mib, 100 * mib, 0, mib, buckets=[])
    assert build.max_kv_blocks == 80 - 0  # 80 MiB free beside weights (no temporaries), 1 MiB a block
    build.buckets = [type("B", (), {"temp_bytes": 30 * mib, "cache_copy_bytes": 20 * mib})()]
    # 10 MiB of temporaries stay fixed; the 20 MiB of copies are 0.2 MiB per block of 100
    assert build.max_kv_blocks == int(70 * mib // (1.2 * mib))


def test_laid_out_bytes_pad_the_minor_dims_to_the_first_tile():
    """program.laid_out_bytes: the default model's bfloat16 cache in the TPU kernels' layout
    ((3, 64) in (4, 128) tiles) is 8/3 its values (the figure memory_analysis gave for the compiled
    step's arguments on v5e-1, BUILD_NOTES "Compiled for the targets", stop 43); a layout in
    another dim order pads its own minor dims; no format or no tiling is dense."""
    import jax
    import numpy as np
    from jax.experimental.layout import Format, Layout

    from engine.step.program import laid_out_bytes

    shape, bf16 = (30, 1024, 16, 3, 64), np.dtype("bfloat16")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    kernels = Format(Layout(major_to_minor=(0, 1, 2, 3, 4), tiling=((4, 128), (2, 1))), one)
    assert laid_out_bytes(shape, bf16, kernels) == 30 * 1024 * 16 * 4 * 128 * 2 == 480 * 2**20
    xlas = Format(Layout(major_to_minor=(0, 2, 3, 4, 1), tiling=((8, 128), (2, 1))), one)  # blocks minor-most
    assert laid_out_bytes(shape, bf16, xlas) == 30 * 16 * 3 * 64 * 1024 * 2
    assert laid_out_bytes(shape, bf16, None) == laid_out_bytes(shape, bf16, Format(Layout((0, 1, 2, 3, 4)), one)) \
        == 30 * 1024 * 16 * 3 * 64 * 2


def test_gguf_quantization_is_refused_by_name():
    config = EngineConfig(model="random:tiny", quantization="gguf", **SMALL)
    with pytest.raises(ValueError, match="quantization=gguf serves a GGUF file's own blocks"):
        compile_for_target(config, TINY, "cpu", progress=None)


def test_too_few_devices_is_named():
    config = EngineConfig(model="random:tiny", tensor_parallel_size=64, **SMALL)
    with pytest.raises(ValueError, match="needs 64 devices, the target has"):
        compile_for_target(config, TINY, "cpu", progress=None)


# ---- the device compilers (make aot-setup; make aot-test) --------------------------------------


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_small_model_step_compiles_for_a_tpu_topology_at_tp2():
    config = EngineConfig(model="random:tiny", tensor_parallel_size=2, **SMALL)
    build = compile_for_target(config, TINY, "v5e-4", progress=None)
    assert build.attention_backend == "pallas_tpu" and build.dtype == "bfloat16" and build.fits
    for bucket in build.buckets:
        assert bucket.collectives_per_layer["all-reduce"] == 2
        assert bucket.flops and bucket.roofline_step_s  # XLA:TPU's cost analysis answers
    r = aot.report(build, TINY, config)
    assert abs(r["capacity_prediction"]["weights_ratio"] - 1) < 0.05


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_the_tpu_steps_pin_the_cache_layout_and_unpinned_copies_are_named(monkeypatch):
    """3 kv heads of 64 lanes (the default model's attention shape on a tiny model): XLA:TPU would
    lay the cache parameter out on its own and copy it for the Mosaic kernels around each step
    (docs/tpu_gpu.md). As the runner compiles the steps (the layout chosen by the first compile,
    then pinned: program.pins_cache_layout) they hold no such copy, and the build counts the cache
    as the kernels lay it out (padded: (3, 64) in (4, 128) tiles, 2.67x); unpinned (the rule
    patched off), the build counts the copies, charges them per block (a smaller largest cache
    than pinned) and the report names them. A pool sized from a budget is sized by the padded
    bytes (engine/step/tpu_cache_layout.py, as the engine's builder does)."""
    import dataclasses

    from experiments.lab import aot_build

    model = dataclasses.replace(preset_config("tiny-gqa3"), head_dim=64)
    config = EngineConfig(model="random:tiny-gqa3", num_kv_blocks=256, **SMALL)
    pinned = compile_for_target(config, model, "v5e-1", roofline=False, progress=None)
    assert pinned.attention_backend == "pallas_tpu" and pinned.cache_copy_bytes == 0
    assert pinned.kv_layout_factor == pytest.approx(8 / 3)  # 4 x 128 lanes hold 3 x 64 values
    # The probe the builder sizes the pool with (the kernels alone, a 16-block cache) sees the same.
    from engine.step.tpu_cache_layout import laid_out_factor
    from experiments.lab.targets import compile_only_devices

    device = compile_only_devices("v5e-1")[0]
    assert laid_out_factor(model, block_size=16, dtype="bfloat16", kv_cache_dtype="auto",
                           device=device) == pytest.approx(pinned.kv_layout_factor)
    budget_bound = EngineConfig(model="random:tiny-gqa3", kv_cache_memory_fraction=1e-4,
                                **dict(SMALL, max_model_len=1024))
    small = compile_for_target(budget_bound, model, "v5e-1", roofline=False, progress=None)
    budget = int((small.usable_bytes - small.weights_bytes) * 1e-4)
    assert small.kv_cache_laid_out_bytes <= budget  # sized by the padded bytes: it fits its budget
    assert small.kv_cache_laid_out_bytes + small.kv_cache_laid_out_bytes // (small.num_blocks - 1) > budget
    r = aot.report(pinned, model, config)
    assert r["per_device_bytes"]["kv_cache_laid_out"] == pinned.kv_cache_laid_out_bytes
    assert "the kernels' layout pads the KV cache" in aot.format_report(r)
    monkeypatch.setattr(aot_build, "pins_cache_layout", lambda backend: False)
    build = compile_for_target(config, model, "v5e-1", roofline=False, progress=None)
    assert build.cache_copy_bytes >= build.kv_cache_bytes and build.kv_layout_factor == 1.0
    fixed = build.usable_bytes - build.weights_bytes - build.table_bytes - (build.temp_bytes - build.cache_copy_bytes)
    assert build.max_kv_blocks < fixed // build.kv_bytes_per_block and build.max_kv_blocks < pinned.max_kv_blocks
    r = aot.report(build, model, config)
    assert r["per_device_bytes"]["cache_copies"] == build.cache_copy_bytes
    assert "XLA copies the KV cache around the kernels" in aot.format_report(r)


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_small_model_step_compiles_for_a_gpu_target(tmp_path):
    path = tmp_path / "h100.json"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.aot", "--target=h100", "--model=random:tiny-qwen2",
         "--max_num_seqs=4", "--max_num_batched_tokens=8", "--token_buckets=4,8",
         "--seq_buckets=4", f"--output_json={path}"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(path.read_text())
    assert r["attention_backend"] == "pallas_gpu" and r["fits"] is True
    assert r["hbm_bytes"] > 70 * 2**30 and [b["compile_s"] > 0 for b in r["buckets"]] == [True] * 3


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
@pytest.mark.parametrize("target, quantization, kv_cache_dtype", [("v5e-1", "int8", "int8"),
                                                                  ("h100", "fp8", "fp8_e4m3")])
def test_quantized_weights_and_an_8bit_cache_compile_and_match_the_calculator(target, quantization,
                                                                              kv_cache_dtype):
    """Quantized weights and an 8-bit cache through the target's Pallas kernels: the compiled
    weights and KV bytes are experiments.capacity's to the byte (ratios 1.000)."""
    config = EngineConfig(model="random:tiny", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          **SMALL)
    build = compile_for_target(config, TINY, target, roofline=False, progress=None)
    assert build.attention_backend in ("pallas_tpu", "pallas_gpu") and build.fits
    r = aot.report(build, TINY, config)
    assert (r["quantization"], r["kv_cache_dtype"]) == (quantization, kv_cache_dtype)
    p = r["capacity_prediction"]
    assert p["weights_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert p["kv_bytes_per_token_ratio"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_the_tpu_roofline_counts_every_layer_of_the_loop():
    """XLA's cost analysis counts a while loop's body once: the scanned step's own FLOPs hold one
    layer. The report's figures (the step unrolled at 2 and 3 layers, extrapolated) equal those of
    the step compiled unrolled over all six layers."""
    import dataclasses

    from experiments.lab.aot_build import _cost

    model = dataclasses.replace(TINY, num_layers=6)
    small = dict(SMALL, token_buckets=(4,), max_num_batched_tokens=4, prompt_scoring_bucket=False)
    scanned = compile_for_target(EngineConfig(model="random:tiny", **small), model, "v5e-1", progress=None)
    unrolled = compile_for_target(EngineConfig(model="random:tiny", scan_layers=False, **small), model,
                                  "v5e-1", progress=None)
    assert (scanned.layer_loop, unrolled.layer_loop) != ("unrolled", "unrolled")
    s, u = scanned.buckets[0], unrolled.buckets[0]
    assert _cost(s.executable)[0] < 0.5 * u.flops  # the loop's body counted once
    assert s.flops == pytest.approx(u.flops, rel=0.02)
    assert s.bytes_accessed == pytest.approx(u.bytes_accessed, rel=0.1)


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
@pytest.mark.parametrize("target", ["v5e-1", "h100"])
def test_speculative_drafts_compile_with_their_own_programs(target):
    """draft_model: its runner's buckets (one more token bucket); draft_head: its chain per
    sequence bucket over the target's hidden states; both counted in the bytes per device."""
    from engine.spec_decode.draft_head import DraftHeadConfig

    spec = SpeculativeConfig.from_value({"method": "draft_model", "model": "random:tiny",
                                         "num_speculative_tokens": 2})
    config = EngineConfig(model="random:tiny", speculative_config=spec, **SMALL)
    build = compile_for_target(config, TINY, target, draft_model=TINY, progress=None)
    d = build.draft
    assert [(p["padded_tokens"], p["padded_seqs"]) for p in d["programs"]] == [(4, 4), (8, 4), (12, 4)]
    assert d["weights_bytes"] > 0 and d["kv_cache_bytes"] == build.kv_cache_bytes  # same shape, blocks
    assert build.total_bytes > build.weights_bytes + build.kv_cache_bytes + d["weights_bytes"] and build.fits

    spec = SpeculativeConfig.from_value({"method": "draft_head", "model": "/nonexistent",
                                         "num_speculative_tokens": 2})
    head = DraftHeadConfig.for_target(TINY, draft_vocab_size=64)
    config = EngineConfig(model="random:tiny", speculative_config=spec, **SMALL)
    build = compile_for_target(config, TINY, target, draft_head=head, progress=None)
    assert [p["padded_seqs"] for p in build.draft["programs"]] == [4] and build.fits
    assert build.draft["weights_bytes"] > 64 * TINY.hidden_size * 4  # lm_draft, float32
    assert "draft (draft_head" in aot.format_report(aot.report(build, TINY, config))


# ---- saved executables, loaded by another process -------------------------------------------

_SERVE = ("import json, sys\n"
          "from engine import LLM, SamplingParams\n"
          "from engine.step.model_runner import num_backend_compilations\n"
          "kw = dict(max_num_seqs=4, max_num_batched_tokens=8, token_buckets=(4, 8), seq_buckets=(4,),"
          " max_model_len=128, precompile=True)\n"
          "folder = sys.argv[1] or None\n"
          "llm = LLM('random:tiny', load_executables=folder, **kw)\n"
          "before = num_backend_compilations()\n"
          "outs = llm.generate([[1, 2, 3], [7, 8, 9, 10, 11]], SamplingParams(temperature=0, max_tokens=6,"
          " ignore_eos=True), use_tqdm=False)\n"
          "print(json.dumps({'tokens': [o.outputs[0].token_ids for o in outs],"
          " 'step_compiles': num_backend_compilations() - before}))\n")


def _generate(folder: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SERVE, folder], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_saved_executables_load_in_another_process_with_equal_outputs(tmp_path):
    folder = tmp_path / "exe"
    saved = subprocess.run(
        [sys.executable, "-m", "experiments.aot", "--target=cpu", "--model=random:tiny",
         "--max_num_seqs=4", "--max_num_batched_tokens=8", "--token_buckets=4,8", "--seq_buckets=4",
         "--max_model_len=128", f"--save_executables={folder}"], capture_output=True, text=True,
        timeout=600)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "step_T4_S4_L4.pkl", "step_T8_S4_L4.pkl", "step_T8_S4_L8.pkl"]
    # compiled with the decode rows the engine runs here (the native kernel, a custom call the
    # loading process registers before it loads them)
    assert json.loads((folder / "manifest.json").read_text())["knobs"]["rows_kernel"] == "native"
    loaded, compiled = _generate(str(folder)), _generate("")
    assert loaded["tokens"] == compiled["tokens"]
    assert loaded["step_compiles"] == 0  # every program loaded, the scoring bucket too


def test_a_manifest_that_differs_is_refused_by_field(tmp_path):
    from engine.step.executables import MANIFEST, load_executables

    folder = tmp_path / "exe"
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps({"knobs": {"block_size": 32}}))
    with pytest.raises(ValueError, match="built for knobs.block_size=32, this engine has knobs.block_size=16"):
        load_executables(str(folder), {"knobs": {"block_size": 16}}, [])
    with pytest.raises(FileNotFoundError, match="no manifest"):
        load_executables(str(tmp_path), {}, [])


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_a_model_mixing_windows_compiles_the_engines_two_cache_groups():
    """random:tiny-gemma3 (3 sliding layers, 1 global): the program and the cache the engine would
    run, a group per layer kind (engine/step/kv_cache.py), so its manifest matches a server's."""
    from engine.core.builder import build_parts

    config = EngineConfig(model="random:tiny-gemma3", max_num_seqs=4, max_num_batched_tokens=8,
                          token_buckets=(8,), seq_buckets=(4,), max_model_len=128, prompt_scoring_bucket=False)
    build = compile_for_target(config, preset_config("tiny-gemma3"), "cpu", progress=None)
    runner = build_parts(config, progress=False).runner
    assert build.fits and build.shapes == runner.shapes and build.shapes.num_sliding_blocks == 14
    assert [x.shape[:2] for x in runner.kv_cache] == [(1, 33), (1, 33), (3, 14), (3, 14)]
    assert build.kv_cache_bytes == sum(x.nbytes for x in runner.kv_cache)
