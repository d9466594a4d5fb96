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


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_why_the_gpu_unrolls_its_layers():
    """The reason behind the GPU's default, as the compilers state it: a scan over stacked
    weights compiled for a GPU holds a copy of one layer's weights (XLA:GPU copies each slice out
    of the stack before its product), for a TPU none; the same layers unrolled hold none on the
    GPU. When a new XLA stops copying, this fails and the default should be measured again."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from experiments.lab.targets import compile_only_devices

    layers, out, inp = 4, 8192, 1024
    slice_bytes = out * inp * 2

    def scanned(w, x):
        def body(h, wl):
            return h + jnp.dot(h.astype(wl.dtype), wl.T, preferred_element_type=jnp.float32)[:, :inp], None
        return jax.lax.scan(body, x, w)[0]

    def unrolled(w, x):
        for i in range(layers):
            x = x + jnp.dot(x.astype(w.dtype), w[i].T, preferred_element_type=jnp.float32)[:, :inp]
        return x

    def temp(fn, target):
        shard = SingleDeviceSharding(compile_only_devices(target)[0])
        args = (jax.ShapeDtypeStruct((layers, out, inp), jnp.bfloat16, sharding=shard),
                jax.ShapeDtypeStruct((8, inp), jnp.float32, sharding=shard))
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp(scanned, "h100") >= slice_bytes
    assert temp(unrolled, "h100") < slice_bytes // 10
    assert temp(scanned, "v5e-1") < slice_bytes // 10


def test_an_unrolled_programs_collectives_split_into_layers_and_the_rest():
    """The GPU's unrolled steps have no loop body to read a layer's collectives from: the whole
    multiples of the layer count are the layers' (experiments/lab/aot_results.split_unrolled)."""
    from experiments.lab.aot_results import split_unrolled

    per_layer, rest = split_unrolled({"all-reduce": 65, "all-gather": 1, "all-to-all": 0}, 32)
    assert per_layer == {"all-reduce": 2, "all-gather": 0, "all-to-all": 0}
    assert rest == {"all-reduce": 1, "all-gather": 1, "all-to-all": 0}
