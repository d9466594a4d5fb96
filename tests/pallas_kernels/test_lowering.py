"""Both Pallas kernels lower for their real platforms, from this CPU-only machine.

jax.export lowers the whole jitted op for platform "tpu" (under an abstract TPU device, so the
Mosaic lowering sees a TPU target) and "cuda". This runs JAX's Pallas lowering rules (Mosaic MLIR,
Triton IR) and checks the kernel is embedded as a tpu_custom_call / Triton custom call. It does
not run Mosaic's own layout passes or Triton's compiler: those happen on the device.
"""

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

from pallas_kernels import ragged_paged_attention
from pallas_kernels.gpu import ragged_paged_attention_gpu

TRITON_CALL = "__gpu$xla.gpu.triton"


def _abstract_args(
    dtype, *, T=48, S=6, max_blocks=9, num_blocks=64, block_size=16, hkv=2, g=4, d=128
):
    return (
        jax.ShapeDtypeStruct((T, hkv * g, d), dtype),
        jax.ShapeDtypeStruct((num_blocks, block_size, hkv, d), dtype),
        jax.ShapeDtypeStruct((num_blocks, block_size, hkv, d), dtype),
        jax.ShapeDtypeStruct((S,), jnp.int32),
        jax.ShapeDtypeStruct((S, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((S + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


@pytest.mark.parametrize(
    "dtype, options, shape",
    [
        (jnp.bfloat16, dict(), dict()),
        (jnp.bfloat16, dict(sliding_window=64, soft_cap=30.0), dict(g=3, d=64, block_size=32)),
        (jnp.float32, dict(), dict(T=8, S=8, g=1)),
    ],
)
def test_tpu_kernel_exports_for_tpu(dtype, options, shape):
    fn = jax.jit(
        lambda *a: ragged_paged_attention(*a, sm_scale=0.1, backend="pallas_tpu", **options)
    )
    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(fn, platforms=["tpu"])(*_abstract_args(dtype, **shape))
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "ragged_paged_attention_tpu" in text


@pytest.mark.parametrize(
    "dtype, options",
    [
        (jnp.bfloat16, dict()),  # the heuristic picks split-K for this small grid
        (jnp.bfloat16, dict(num_kv_splits=1, sliding_window=64, soft_cap=30.0)),
        (jnp.float32, dict(num_kv_splits=4)),
    ],
)
def test_gpu_kernel_exports_for_cuda(dtype, options):
    fn = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.1, **options))
    exported = jax.export.export(
        fn,
        platforms=["cuda"],
        # Triton calls carry no export-compatibility guarantee; this check is about lowering.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*_abstract_args(dtype))
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    assert TRITON_CALL in text and "ragged_paged_attention_gpu" in text


def test_gpu_kernel_rejects_non_power_of_two_head_dim():
    args = _abstract_args(jnp.float32, d=96)
    with pytest.raises(ValueError, match="head_dim"):
        jax.eval_shape(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.1), *args)
