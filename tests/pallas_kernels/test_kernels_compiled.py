"""Both Pallas kernels compiled by the real device compilers on the CPU (marker `aot`).

Mosaic for v5e and v6e TPU topologies (`pallas_tpu`), Triton for sm_90 (H100) and sm_80 (A100)
(`pallas_gpu`), through the public entry the engine calls (`prepare_attention_metadata` and
`ragged_paged_attention` in one jitted function, as a step does, with the KV write beside it),
compiled for the compile-only devices of experiments/lab/targets.py. The cases cover the shapes the
engine uses: head_dim 64 and 128; 1, 3 and 8 query heads per KV head; block sizes 16 to 128;
bfloat16 and float32; a sliding window; a soft cap; a stacked cache read at a traced layer and a
single-layer cache. Each compiled program must answer `memory_analysis()`, and on the GPU its
serialized executable must hold the Triton kernel. The numerics are the interpret-mode tests'
(test_tpu.py, test_gpu.py) against the reference; `-m gpu` / `-m tpu` run them on a device.

    make aot-test        # (after make aot-setup) or: pytest tests/pallas_kernels -m aot
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from experiments.lab.targets import compile_only_devices
from pallas_kernels import prepare_attention_metadata, ragged_paged_attention, write_kv

pytestmark = pytest.mark.aot


@dataclasses.dataclass(frozen=True)
class Shape:
    head_dim: int = 128
    group: int = 1  # query heads per KV head
    num_kv_heads: int = 1
    block_size: int = 16
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    soft_cap: float | None = None
    stacked: bool = True
    num_tokens: int = 32
    num_seqs: int = 8
    num_blocks: int = 64
    max_blocks_per_seq: int = 8


# A covering set, not the product: every value of every axis appears, in the combinations the
# engine's models produce (the default model: D 64, 3 KV heads of 3 queries; Llama-3 per TP shard:
# D 128, 1-2 KV heads of 4; Qwen2/Mistral: groups of 7-8, windows).
SHAPES = [
    Shape(),
    Shape(head_dim=64, group=3, num_kv_heads=3, dtype="float32", stacked=False),
    Shape(head_dim=64, group=3, num_kv_heads=1, block_size=32),
    Shape(head_dim=128, group=8, num_kv_heads=2, block_size=64, sliding_window=48),
    Shape(head_dim=128, group=4, num_kv_heads=1, block_size=128, dtype="float32", soft_cap=30.0),
    Shape(head_dim=64, group=1, num_kv_heads=2, block_size=16, num_tokens=8, num_seqs=8),  # decode
]
TARGETS = {"pallas_tpu": ("v5e-4", "v6e-4"), "pallas_gpu": ("h100", "a100")}


def _abstract(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))


def _step(q, k_new, v_new, k_cache, v_cache, slots, seq_lens, block_tables, query_start_loc,
          num_seqs, layer, *, s: Shape, backend: str):
    """One layer of a step: metadata, the KV write, the attention (as models/llama.py does)."""
    md = prepare_attention_metadata(
        seq_lens, block_tables, query_start_loc, num_seqs, num_tokens=s.num_tokens,
        num_q_heads=s.group * s.num_kv_heads, num_kv_heads=s.num_kv_heads,
        block_size=s.block_size, backend=backend, sliding_window=s.sliding_window, head_dim=s.head_dim)
    index = layer if s.stacked else None
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layer=index)
    out = ragged_paged_attention(q, k_cache, v_cache, md, layer=index, sm_scale=1 / math.sqrt(s.head_dim),
                                 sliding_window=s.sliding_window, soft_cap=s.soft_cap, backend=backend)
    return out, k_cache, v_cache


def _compile(s: Shape, backend: str, target: str):
    device = compile_only_devices(target)[0]
    dt = jnp.dtype(s.dtype)
    hq, hkv, d = s.group * s.num_kv_heads, s.num_kv_heads, s.head_dim
    cache = ((2,) if s.stacked else ()) + (s.num_blocks, s.block_size, hkv, d)
    i32 = np.int32
    args = (
        _abstract((s.num_tokens, hq, d), dt, device),
        _abstract((s.num_tokens, hkv, d), dt, device), _abstract((s.num_tokens, hkv, d), dt, device),
        _abstract(cache, dt, device), _abstract(cache, dt, device),
        _abstract((s.num_tokens,), i32, device), _abstract((s.num_seqs,), i32, device),
        _abstract((s.num_seqs, s.max_blocks_per_seq), i32, device),
        _abstract((s.num_seqs + 1,), i32, device), _abstract((), i32, device), _abstract((), i32, device),
    )
    step = jax.jit(functools.partial(_step, s=s, backend=backend), donate_argnums=(3, 4))
    return step.lower(*args).compile()


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: (
    f"D{s.head_dim}-G{s.group}-K{s.num_kv_heads}-B{s.block_size}-{s.dtype}"
    f"{'-win' if s.sliding_window else ''}{'-cap' if s.soft_cap else ''}{'-stacked' if s.stacked else ''}"))
def test_kernel_compiles_for_the_device(backend, shape):
    from jax.experimental.serialize_executable import serialize

    for target in TARGETS[backend]:
        compiled = _compile(shape, backend, target)
        mem = compiled.memory_analysis()
        assert mem is not None and mem.argument_size_in_bytes > 0, target
        if backend == "pallas_gpu":
            payload = serialize(compiled)[0]
            # The Triton kernel is compiled into the executable (a cubin, named after the kernel).
            assert len(payload) > 10_000 and b"ragged" in payload, target
