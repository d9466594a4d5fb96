"""Choices the step makes by platform are made by the platform it is lowered for
(jax.lax.platform_dependent), so experiments.aot, compiling for a TPU or a GPU on a CPU host,
compiles the device's programs and not the CPU's (models/layers.py, models/quant.py); and the
layer loop per platform (engine/config.py)."""

import pytest

from engine.config import EngineConfig, resolve_layer_loop


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_the_embedding_lookup_copies_no_table_on_a_tpu():
    """models/layers.embed_tokens gathers a 16-bit table as its bits on the CPU only: XLA:TPU
    made the bits a copy of the whole table every step (Llama-3-8B: 1 GB of temporaries). The
    platform is the lowering's, so this compile on a CPU host takes the TPU's gather."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from experiments.lab.targets import compile_only_devices
    from models.layers import embed_tokens

    table_bytes = 128256 * 4096 * 2  # Llama-3-8B's table
    for name in ("v5e-1", "cpu"):
        device = compile_only_devices(name)[0] if name != "cpu" else jax.devices("cpu")[0]
        shard = SingleDeviceSharding(device)
        args = (jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16, sharding=shard),
                jax.ShapeDtypeStruct((8,), jnp.int32, sharding=shard))
        compiled = jax.jit(embed_tokens).lower(*args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < table_bytes // 100, name
        gathers_bits = "u16[8,4096]" in compiled.as_text()
        assert gathers_bits == (name == "cpu"), name


def test_the_layer_loop_per_platform():
    """CPU: the switch scan; TPU: the stacked scan (XLA:TPU reads a layer's slice in place); GPU:
    unrolled (XLA:GPU copies a stacked layer's weights every step; the switch scan's products are
    conditionals the host reads back). BUILD_NOTES.md "Compiled for the targets", stop 44."""
    config = EngineConfig(model="random:tiny")
    assert [resolve_layer_loop(config, p) for p in ("cpu", "tpu", "gpu")] == ["switch", "stacked", "unrolled"]
    scanned = EngineConfig(model="random:tiny", scan_layers=True)
    assert resolve_layer_loop(scanned, "gpu") == "stacked"  # asked for by name, still served
