"""Both Pallas kernels lower for their real platforms, from this CPU-only machine.

jax.export lowers the whole jitted op for platform "tpu" (under an abstract TPU device, so the
Mosaic lowering sees a TPU target) and "cuda". This runs JAX's Pallas lowering rules (Mosaic MLIR,
Triton IR) and checks the kernel is embedded as a tpu_custom_call / Triton custom call. Each
export prepares the metadata and runs one layer of a stacked [L, ...] cache, with the layer a
traced argument or a Python int, or a single-layer 4-D cache. It does not run Mosaic's own layout
passes or Triton's compiler: those happen on the device.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

from pallas_kernels import prepare_attention_metadata, ragged_paged_attention

TRITON_CALL = "__gpu$xla.gpu.triton"
NUM_LAYERS = 4


def _abstract_args(
    dtype,
    *,
    T=48,
    S=6,
    max_blocks=9,
    num_blocks=64,
    block_size=16,
    hkv=2,
    g=4,
    d=128,
    stacked=True,
):
    """(q, k_cache, v_cache, seq_lens, block_tables, query_start_loc, num_seqs, layer)."""
    cache = (NUM_LAYERS,) * stacked + (num_blocks, block_size, hkv, d)
    return (
        jax.ShapeDtypeStruct((T, hkv * g, d), dtype),
        jax.ShapeDtypeStruct(cache, dtype),
        jax.ShapeDtypeStruct(cache, dtype),
        jax.ShapeDtypeStruct((S,), jnp.int32),
        jax.ShapeDtypeStruct((S, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((S + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


def _layer_fn(backend, layer_mode, options, tuning=None):
    """prepare + one layer's call; layer_mode "traced" (the layer argument), "static" (layer 2)
    or "single" (a 4-D cache, layer=None)."""

    def fn(q, k_cache, v_cache, seq_lens, block_tables, query_start_loc, num_seqs, layer):
        T, hq, d = q.shape
        md = prepare_attention_metadata(
            seq_lens,
            block_tables,
            query_start_loc,
            num_seqs,
            num_tokens=T,
            num_q_heads=hq,
            num_kv_heads=k_cache.shape[-2],
            block_size=k_cache.shape[-3],
            backend=backend,
            sliding_window=options.get("sliding_window"),
            head_dim=d,
            **(tuning or {}),
        )
        layer = {"traced": layer, "static": 2, "single": None}[layer_mode]
        return ragged_paged_attention(
            q, k_cache, v_cache, md, layer=layer, sm_scale=0.1, backend=backend, **options
        )

    return jax.jit(fn)


def _assert_cache_passed_in_place(text: str) -> None:
    """The cache arguments (%arg1, %arg2) reach the kernel's custom call directly or through a
    reshape (a bitcast): never sliced, gathered or copied per layer outside the kernel."""
    main = text[text.index("func.func public @main") :]
    main = main[: main.index("func.func", 1)] if "func.func" in main[1:] else main
    assert 'loc("k_cache")' in main.splitlines()[0] and "%arg1:" in main.splitlines()[0]
    uses = [line.strip() for line in main.splitlines()[1:] if re.search(r"%arg[12]\b", line)]
    assert uses
    for line in uses:
        op = re.search(r"=\s*\"?([\w.]+)", line)
        assert op and op.group(1) in ("stablehlo.custom_call", "stablehlo.reshape"), line


@pytest.mark.parametrize(
    "dtype, options, shape, layer_mode",
    [
        (jnp.bfloat16, dict(), dict(), "traced"),
        (
            jnp.bfloat16,
            dict(sliding_window=64, soft_cap=30.0),
            dict(g=3, d=64, block_size=32),
            "static",
        ),
        (jnp.float32, dict(), dict(T=8, S=8, g=1, stacked=False), "single"),
    ],
)
def test_tpu_kernel_exports_for_tpu(dtype, options, shape, layer_mode):
    fn = _layer_fn("pallas_tpu", layer_mode, options)
    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(fn, platforms=["tpu"])(*_abstract_args(dtype, **shape))
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "ragged_paged_attention_tpu" in text
    _assert_cache_passed_in_place(text)


@pytest.mark.parametrize(
    "dtype, tuning, options, layer_mode",
    [
        (jnp.bfloat16, dict(), dict(), "traced"),  # the heuristic picks split-K for this grid
        (
            jnp.bfloat16,
            dict(num_kv_splits=1),
            dict(sliding_window=64, soft_cap=30.0),
            "static",
        ),
        (jnp.float32, dict(num_kv_splits=4), dict(), "single"),
    ],
)
def test_gpu_kernel_exports_for_cuda(dtype, tuning, options, layer_mode):
    fn = _layer_fn("pallas_gpu", layer_mode, options, tuning)
    exported = jax.export.export(
        fn,
        platforms=["cuda"],
        # Triton calls carry no export-compatibility guarantee; this check is about lowering.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*_abstract_args(dtype, stacked=layer_mode != "single"))
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    assert TRITON_CALL in text and "ragged_paged_attention_gpu" in text
    _assert_cache_passed_in_place(text)


def test_gpu_kernel_rejects_non_power_of_two_head_dim():
    args = _abstract_args(jnp.float32, d=96)
    with pytest.raises(ValueError, match="head_dim"):
        jax.eval_shape(_layer_fn("pallas_gpu", "traced", {}), *args)
