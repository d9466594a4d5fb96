"""Both Pallas kernels compiled by the real device compilers on this CPU-only machine (marker `aot`).

Mosaic and XLA:TPU for a v5e and a v6e topology (backend "pallas_tpu"), Triton, ptxas and XLA:GPU
for sm_90 (H100) and sm_80 (A100) (backend "pallas_gpu"), on the compile-only devices of
experiments/lab/targets.py (the `aot` extra: `make aot-setup`, then `make aot-test`). Each case is
one layer of a step as models/llama.py runs it: the metadata, the KV write (write_kv) and the
attention in one jit, lowered with abstract arguments placed on the target device and compiled.

The grid is a covering design over the shapes the engine uses, not their product: head_dim 64 and
128; 1, 3 and 8 query heads per KV head (1, 2, 3 and 8 KV heads); block sizes 16, 32, 64, 128;
bfloat16 and float32; a sliding window; a soft cap; a stacked [L, ...] cache read at a traced or a
static layer, and a single-layer cache; decode, mixed and prefill batches (the first two cases are
the default model's, SmolLM2-135M: D 64, 3 KV heads of 3 queries). Every pair of head_dim, group,
block size and dtype values meets at least once. Then the cases the kernels had to be fixed for
(Triton's shared memory on large float32 tiles: the rows are split over programs; Mosaic's scoped
VMEM on many KV heads: the kernel asks for more), and the shapes they refuse, with the error that
names the limit and the knob. And an 8-bit cache (int8 and fp8_e4m3 values with bfloat16 scale
arrays, pallas_kernels/kv_quant.py) on three shapes, every layout (traced, single, static) and
both kernels on every target: the default model's decode, one kv head (the TPU's heads_major
pages) and float32 prefill of 8 heads per kv head over 64-token pages (its rows split over
programs on the GPU).

A compiled case must hold its kernel (the Mosaic or Triton custom call, by name), answer
memory_analysis() with the caches among its arguments, and carry device code: TPU machine code
(generated_code_size_in_bytes) or, on the GPU, a cubin (ptxas' ELF) in the serialized executable. The numerics are the interpret-mode tests'
(test_pallas_interpret.py) and, on a device, test_compiled_on_device.py's.
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
from pallas_kernels import (
    gpu_tiles,
    metadata,
    prepare_attention_metadata,
    ragged_paged_attention,
    tpu,
    write_kv,
)
from pallas_kernels.kv_quant import ScaledCache, allocate_scaled, scale_layout

pytestmark = [pytest.mark.aot, pytest.mark.usefixtures("no_persistent_cache")]

TPU_TARGETS = ("v5e-4", "v6e-1")  # a 2x2 slice's first chip, and a single chip
GPU_TARGETS = ("h100", "a100")  # sm_90 (as H200) and sm_80
KIND_SIZES = {"decode": (16, 16), "mixed": (64, 8), "prefill": (128, 1)}  # (tokens T, seqs S)
NUM_LAYERS = 3


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # a key of KIND_SIZES
    head_dim: int
    group: int  # query heads per KV head
    num_kv_heads: int
    block_size: int
    dtype: str
    sliding_window: int | None = None
    soft_cap: float | None = None
    layout: str = "traced"  # "traced" | "static" (a stacked cache) | "single" (a 4-D cache)
    max_model_len: int = 512
    num_blocks: int = 96
    tuning: tuple = ()  # prepare_attention_metadata overrides, as (name, value) pairs
    kv: str = "auto"  # kv_cache_dtype: "auto" (the cache in `dtype`), "int8", "fp8_e4m3"

    @property
    def id(self) -> str:
        extras = "".join(
            f"-{name}" for name, on in (("win", self.sliding_window), ("cap", self.soft_cap)) if on
        )
        return (
            f"{self.kind}-D{self.head_dim}-G{self.group}-K{self.num_kv_heads}-B{self.block_size}-"
            f"{self.dtype}{extras}-{self.layout}{'' if self.kv == 'auto' else '-kv_' + self.kv}"
        )


BF16, F32 = "bfloat16", "float32"
SHAPES = [
    Shape("decode", 64, 3, 3, 16, BF16),  # the default model
    Shape("mixed", 64, 3, 3, 16, BF16),
    Shape("prefill", 128, 8, 1, 32, BF16, sliding_window=48, layout="single"),
    Shape("decode", 128, 1, 8, 64, F32, soft_cap=30.0),
    Shape("decode", 64, 8, 2, 128, F32, sliding_window=200, soft_cap=50.0),
    Shape("mixed", 128, 3, 2, 128, BF16, soft_cap=30.0, layout="single"),
    Shape("prefill", 64, 1, 1, 32, F32, layout="single"),
    Shape("prefill", 128, 8, 2, 16, BF16, layout="static"),
    Shape("mixed", 64, 8, 8, 64, BF16),
    Shape("prefill", 128, 1, 3, 128, BF16, sliding_window=100),
    Shape("mixed", 128, 3, 3, 64, F32, sliding_window=64, layout="single"),
    Shape("decode", 64, 1, 2, 16, BF16, soft_cap=30.0, layout="single"),
]
EIGHT_BIT_SHAPES = [
    Shape("decode", 64, 3, 3, 16, BF16, kv="int8"),  # the default model
    Shape("mixed", 128, 8, 1, 32, BF16, sliding_window=48, layout="single", kv="fp8_e4m3"),
    Shape("prefill", 128, 8, 2, 64, F32, soft_cap=30.0, layout="static", kv="fp8_e4m3", num_blocks=16,
          max_model_len=256),
]


def _abstract(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))


def _step(q, k_new, v_new, k_cache, v_cache, slots, seq_lens, block_tables, query_start_loc,
          num_seqs, layer, *, s: Shape, backend: str):
    """One layer of a step as models/llama.py runs it: metadata, the KV write, the attention."""
    num_tokens = q.shape[0]
    md = prepare_attention_metadata(
        seq_lens, block_tables, query_start_loc, num_seqs, num_tokens=num_tokens,
        num_q_heads=s.group * s.num_kv_heads, num_kv_heads=s.num_kv_heads,
        block_size=s.block_size, backend=backend, sliding_window=s.sliding_window,
        head_dim=s.head_dim, **dict(s.tuning))
    index = {"traced": layer, "static": NUM_LAYERS - 1, "single": None}[s.layout]
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layer=index, backend=backend)
    out = ragged_paged_attention(
        q, k_cache, v_cache, md, layer=index, sm_scale=1 / math.sqrt(s.head_dim),
        sliding_window=s.sliding_window, soft_cap=s.soft_cap, backend=backend)
    return out, k_cache, v_cache


def _cache_shape(s: Shape) -> tuple[int, ...]:
    stacked = (NUM_LAYERS,) if s.layout != "single" else ()
    return (*stacked, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)


def _lower(s: Shape, backend: str, target: str):
    device = compile_only_devices(target)[0]
    dt = jnp.dtype(s.dtype)
    T, S = KIND_SIZES[s.kind]
    hq, hkv, d = s.group * s.num_kv_heads, s.num_kv_heads, s.head_dim
    max_blocks = -(-s.max_model_len // s.block_size)
    arg = functools.partial(_abstract, device=device)
    if s.kv == "auto":
        cache = arg(_cache_shape(s), dt)
    else:  # values and scales, as the engine allocates them (engine/step/kv_cache.py)
        layout = scale_layout(backend)  # the TPU's scales as rows per page (kv_quant.py "Scale layouts")
        cache = jax.eval_shape(lambda: allocate_scaled(_cache_shape(s), s.kv, layout))
        cache = ScaledCache(arg(cache.values.shape, cache.values.dtype), arg(cache.scales.shape, cache.scales.dtype),
                            s.kv, layout)
    args = (
        arg((T, hq, d), dt), arg((T, hkv, d), dt), arg((T, hkv, d), dt),
        cache, cache,
        arg((T,), np.int32), arg((S,), np.int32), arg((S, max_blocks), np.int32),
        arg((S + 1,), np.int32), arg((), np.int32), arg((), np.int32),
    )
    step = jax.jit(functools.partial(_step, s=s, backend=backend), donate_argnums=(3, 4))
    return step.lower(*args)


def _check_compiled(compiled, s: Shape, backend: str, target: str) -> None:
    text = compiled.as_text()
    if backend == "pallas_tpu":
        assert "tpu_custom_call" in text and "ragged_paged_attention_tpu" in text
        assert "write_kv_tpu" in text  # the Mosaic write, not a scatter
    else:
        assert "__gpu$xla.gpu.triton" in text and "ragged_paged_attention_gpu" in text
    mem = compiled.memory_analysis()
    itemsize = jnp.dtype(s.dtype).itemsize if s.kv == "auto" else 1 + 2 / s.head_dim  # values + scales
    cache_bytes = math.prod(_cache_shape(s)) * itemsize
    assert mem is not None and mem.argument_size_in_bytes >= 2 * cache_bytes
    if backend == "pallas_tpu":
        assert mem.generated_code_size_in_bytes > 0  # TPU machine code
        if s.kv != "auto":  # the page layout's scale rows are read and written in XLA's own layout
            scales = jax.eval_shape(lambda: allocate_scaled(_cache_shape(s), s.kv, "page")).scales.shape
            copies = [line for line in text.splitlines() if " copy(" in line and f"u32[{','.join(map(str, scales))}]" in line]
            assert not copies, f"XLA relayouts the scale rows: {copies[:2]}"
    else:
        from jax.experimental.serialize_executable import serialize

        payload = serialize(compiled)[0]  # compressed: names and PTX text are not greppable
        assert len(payload) > 20_000 and b"\x7fELF" in payload, "no cubin: ptxas did not run"


def _compile_and_check(s: Shape, backend: str, target: str) -> None:
    _check_compiled(_lower(s, backend, target).compile(), s, backend, target)


# One class per compiler: pytest-xdist (--dist loadscope) runs the two on two workers.
class TestMosaic:
    @pytest.mark.parametrize("target", TPU_TARGETS)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
    def test_compiles(self, shape, target):
        _compile_and_check(shape, "pallas_tpu", target)

    @pytest.mark.parametrize("target", TPU_TARGETS)
    @pytest.mark.parametrize("shape", EIGHT_BIT_SHAPES, ids=lambda s: s.id)
    def test_compiles_an_8bit_cache(self, shape, target):
        _compile_and_check(shape, "pallas_tpu", target)

    def test_many_kv_heads_ask_for_more_scoped_vmem(self):
        """64 KV heads (a multi-head 65B model on one chip) of float32 128-token pages: the two
        double-buffered pages alone are 16 MiB, Mosaic's default scoped VMEM on v5e
        (CompileTimeScopedVmemOom before the kernel asked for more)."""
        s = Shape("decode", 128, 1, 64, 128, F32, num_blocks=16)
        rows = metadata.choose_block_q(*KIND_SIZES["decode"], 1, row_multiple=8)  # x 1 head
        assert tpu.vmem_limit(64, rows, 128, 128, jnp.float32, jnp.float32) is not None
        _compile_and_check(s, "pallas_tpu", "v5e-4")

    def test_vmem_beyond_a_tpu_core_is_refused(self):
        s = Shape("decode", 128, 1, 256, 128, F32, num_blocks=4)
        with pytest.raises(ValueError, match=r"MiB of VMEM.*block_size.*tensor_parallel_size"):
            _lower(s, "pallas_tpu", TPU_TARGETS[0])


class TestTriton:
    @pytest.mark.parametrize("target", GPU_TARGETS)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
    def test_compiles(self, shape, target):
        _compile_and_check(shape, "pallas_gpu", target)

    @pytest.mark.parametrize("target", GPU_TARGETS)
    @pytest.mark.parametrize("shape", EIGHT_BIT_SHAPES, ids=lambda s: s.id)
    def test_compiles_an_8bit_cache(self, shape, target):
        _compile_and_check(shape, "pallas_gpu", target)

    @pytest.mark.parametrize("target", GPU_TARGETS)
    def test_large_float32_tiles_are_split_over_programs(self, target):
        """A float32 prefill block of 32 tokens x 8 heads (256 rows) over 128-token pages: its
        tiles need 394 KB of shared memory, more than sm_80 (163 KiB) or sm_90 (227 KiB) have
        (RESOURCE_EXHAUSTED before); the kernel runs it as programs of 32 rows."""
        s = Shape("prefill", 128, 8, 1, 128, F32, num_blocks=16, max_model_len=256)
        assert gpu_tiles.row_chunk(256, 128, 128, 4, full_precision=True) == 32
        _compile_and_check(s, "pallas_gpu", target)

    @pytest.mark.parametrize(
        "shape, match",
        [
            (Shape("mixed", 96, 1, 2, 16, BF16), "power-of-two head_dim"),
            (Shape("mixed", 64, 1, 2, 24, BF16), "power-of-two block_size"),
            (Shape("mixed", 64, 8, 1, 16, BF16, tuning=(("block_q", 3),)),
             "power-of-two block_q"),
            (Shape("mixed", 64, 1, 1, 16, BF16, tuning=(("pages_per_step", 3),)),
             "power-of-two pages_per_step"),
            # 256 kv rows a step of float32 D 128: 288 KB of shared memory even at 16 query rows.
            (Shape("mixed", 128, 1, 1, 128, F32, num_blocks=8, tuning=(("pages_per_step", 2),)),
             r"shared memory.*sm_80.*lower pages_per_step.*block_size.*bfloat16"),
            # float32 over 128 kv rows of an fp8 cache: sm_80 asked for 172,032 B at 16 query rows
            # before the 8-bit tiles were counted (gpu_tiles.shared_memory_bytes).
            (Shape("prefill", 128, 8, 2, 128, F32, num_blocks=16, max_model_len=256, kv="fp8_e4m3"),
             r"shared memory.*sm_80.*lower pages_per_step.*block_size"),
        ],
        ids=["head_dim-96", "block_size-24", "block_q-3", "pages_per_step-3", "smem", "smem-8bit"],
    )
    def test_shapes_triton_cannot_tile_are_refused(self, shape, match):
        with pytest.raises(ValueError, match=match):
            _lower(shape, "pallas_gpu", GPU_TARGETS[0])


def test_engine_refuses_a_block_size_triton_cannot_tile_at_construction():
    """The engine traces its steps while it is built (precompile): a kernel refusal surfaces
    there, before any request, as the kernel's ValueError."""
    from engine.frontends.llm import LLM

    with pytest.raises(ValueError, match="power-of-two block_size"):
        LLM("random:tiny", attention_backend="pallas", interpret=True, block_size=24,
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
            compilation_cache_dir=None, progress=False)
