"""Paged-attention kernels: one ragged contract, three implementations (jax and numpy only).

  prepare_attention_metadata(...)  attention.py: once per step, the batch's AttentionMetadata
  ragged_paged_attention(...)      attention.py: one layer's attention, dispatch by backend
    "xla"         xla.py: pure jnp, the CPU path and the kernels' reference; on the CPU its
                  decode rows can run cpu_native.py's kernel instead (C++ through XLA's FFI,
                  built on first use; the jnp page loop stays its reference and fallback)
    "pallas_tpu"  tpu.py: Pallas TPU (Mosaic) kernel
    "pallas_gpu"  gpu.py: Pallas Triton kernel, plus a split-K variant for decode
  write_kv(...)                    kv_write.py: one donated scatter per cache array
  resolve_backend(...)             backend.py: "auto" | "xla" | "pallas" -> a backend name

The KV cache is one K and one V array for all layers, [L, num_blocks, block_size, Hkv, D]
(kv_layout "token_major"; the xla path also reads and writes "head_major" pages,
[L, num_blocks, Hkv, block_size, D], the layout the engine gives it: `kv_layout_for`);
write_kv and ragged_paged_attention take `layer` (a Python int, or a traced int32 scalar inside a
lax.scan over layers) and read/write that layer's pages in place. A single-layer
[num_blocks, block_size, Hkv, D] cache with layer=None also works (L = 1).

metadata.py holds AttentionMetadata (a pytree: prepared once per step in XLA, closed over or passed
to every layer) and the per-query-block metadata all backends share; validation.py the checks.
"""

from pallas_kernels.attention import prepare_attention_metadata, ragged_paged_attention
from pallas_kernels.backend import resolve_backend
from pallas_kernels.kv_write import write_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.validation import KV_LAYOUTS, kv_layout_for

__all__ = [
    "KV_LAYOUTS",
    "AttentionMetadata",
    "kv_layout_for",
    "prepare_attention_metadata",
    "ragged_paged_attention",
    "resolve_backend",
    "write_kv",
]
