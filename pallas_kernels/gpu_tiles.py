"""How the Triton kernel (gpu.py) tiles a query block: shared memory per program, and the row
chunks that keep it under the limit of every GPU the kernel is compiled for.

One program of the kernel stages in shared memory its q tile [C, D] and a kv step's K and V tiles
[pages_per_step x block_size, D] (twice on sm_90's pipelined 16-bit dots), plus P [C, K] for
float32 dots at full precision. `row_chunk` picks C: the block's R = block_q x Gp rows, halved
until those tiles fit (`shared_memory_bytes` against SHARED_MEMORY_LIMITS); `row_chunk_or_refuse`
raises the error naming the limit and the knobs when not even 16 rows fit. An 8-bit cache's
tiles are converted to q's dtype before the dots, so they are sized at q's itemsize, plus the
8-bit K and V tiles that Triton stages as loaded.
"""

import jax.numpy as jnp

_MIN_ROWS = 16  # Triton's dot wants every dimension >= 16
# Shared memory one program may use (the per-block opt-in limit) on the GPUs the kernel is
# compiled for: sm_80 (A100, 163 KiB) and sm_90 (H100, H200, 227 KiB). Consumer Ampere and Ada
# cards (sm_86, sm_89) have 99 KiB: their largest tiles would need a smaller block_q.
SHARED_MEMORY_LIMITS = {"sm_80": 166_912, "sm_90": 232_448}


def shared_memory_bytes(
    arch: str, rows: int, kv_rows: int, head_dim: int, itemsize: int, full_precision: bool,
    eight_bit: bool = False,
) -> int:
    """Shared memory Triton asks for one program of the kernel on `arch` ("sm_80" | "sm_90").

    The tiles staged there: q [rows, D] and the step's K and V [kv_rows, D]; sm_90's 16-bit dots
    (wgmma) keep two stages of K and V; float32 dots at full precision (no tensor cores) stage
    P [rows, kv_rows] as well. This is what the compilers requested in their refusals (to within
    1 KiB, which is added): bf16 D 128, 512 x 128 rows: 197,120 B (sm_80) and 262,656 B (sm_90);
    float32 D 64, 256 x 128 rows: 263,168 B on both (tests/pallas_kernels/test_device_compile.py).
    An 8-bit cache (eight_bit) also stages the 8-bit K and V tiles as loaded: counted as
    2 x kv_rows x D bytes more, an upper bound of what sm_80 asked for float32 D 128 over
    128 kv rows with an fp8 cache: 180,224 B at 32 query rows, 172,032 B at 16 (this formula:
    197,632 and 181,248; both over sm_80's limit, so that step is refused, as it should be).
    """
    stages = 2 if arch == "sm_90" and not full_precision else 1
    elements = rows * head_dim + 2 * stages * kv_rows * head_dim
    if full_precision:
        elements += rows * kv_rows
    return itemsize * elements + (2 * kv_rows * head_dim if eight_bit else 0) + 1024


def row_chunk(rows: int, kv_rows: int, head_dim: int, itemsize: int, full_precision: bool,
              eight_bit: bool = False):
    """Rows per program: R, halved until the tiles fit every SHARED_MEMORY_LIMITS arch; None when
    not even _MIN_ROWS rows fit (the kv step itself is too large)."""

    def fits(c):
        return all(
            shared_memory_bytes(arch, c, kv_rows, head_dim, itemsize, full_precision, eight_bit) <= limit
            for arch, limit in SHARED_MEMORY_LIMITS.items()
        )

    chunk = rows
    while not fits(chunk):
        if chunk <= _MIN_ROWS or chunk % 2:
            return None
        chunk //= 2
    return chunk


def row_chunk_or_refuse(md, rows: int, head_dim: int, itemsize: int, is_f32: bool, q_dtype,
                        eight_bit: bool = False) -> int:
    """row_chunk for a query block of `rows` rows over md's kv steps; ValueError naming the shared
    memory each arch would need and the knobs that lower it when not even _MIN_ROWS rows fit."""
    bs = md.block_size
    kv_rows = md.pages_per_step * bs
    chunk = row_chunk(rows, kv_rows, head_dim, itemsize, is_f32, eight_bit)
    if chunk is not None:
        return chunk
    need = {
        arch: shared_memory_bytes(arch, _MIN_ROWS, kv_rows, head_dim, itemsize, is_f32, eight_bit)
        for arch in SHARED_MEMORY_LIMITS
    }
    over = ", ".join(
        f"{need[arch]:,} B on {arch} (limit {limit:,} B)"
        for arch, limit in SHARED_MEMORY_LIMITS.items()
        if need[arch] > limit
    )
    raise ValueError(
        f"pallas_gpu: a kv step of pages_per_step={md.pages_per_step} x block_size={bs} = "
        f"{kv_rows} rows of head_dim {head_dim} in {jnp.dtype(q_dtype).name} needs more "
        f"shared memory per program than the GPU has, even at {_MIN_ROWS} query rows: {over}; "
        "lower pages_per_step (prepare_attention_metadata) or block_size "
        f"(EngineConfig.block_size){', or use bfloat16' if is_f32 else ''}"
    )
