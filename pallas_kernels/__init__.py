"""Paged-attention kernels: one ragged contract, three implementations (jax and numpy only).

  ragged_paged_attention(...)  attention.py: dispatch by backend
    "xla"         xla.py: pure jnp, the CPU path and the kernels' reference
    "pallas_tpu"  tpu.py: Pallas TPU (Mosaic) kernel
    "pallas_gpu"  gpu.py: Pallas Triton kernel, plus a split-K variant for decode
  write_kv(...)               kv_write.py: one donated scatter per cache array
  resolve_backend(...)        backend.py: "auto" | "xla" | "pallas" -> a backend name

metadata.py computes the per-query-block metadata that both Pallas kernels share.
"""

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.backend import resolve_backend
from pallas_kernels.kv_write import write_kv

__all__ = ["ragged_paged_attention", "resolve_backend", "write_kv"]
