"""Choosing the attention implementation for a platform.

attention_backend (the user's knob) -> resolved name passed to `ragged_paged_attention`:
  "xla"    -> "xla" everywhere (pure jnp).
  "auto"   -> "pallas_tpu" on a TPU, "pallas_gpu" on a GPU, "xla" on the CPU.
  "pallas" -> "pallas_tpu" on a TPU, "pallas_gpu" on a GPU and on the CPU. On the CPU a Pallas
              kernel only runs with interpret=True (the Triton kernel's interpreter is the
              generic one, so it is the CPU choice); that is how tests compare kernels with xla.
"""

import jax

ATTENTION_BACKENDS = ("auto", "xla", "pallas")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_backend(attention_backend: str, platform: str | None = None) -> str:
    """Maps "auto" | "xla" | "pallas" to "xla" | "pallas_gpu" | "pallas_tpu" for `platform`.

    platform defaults to jax.default_backend(); raises ValueError for an unknown
    attention_backend or platform.
    """
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}; got {attention_backend!r}"
        )
    platform = (platform or jax.default_backend()).lower()
    if platform not in ("cpu", "tpu", *_GPU_PLATFORMS):
        raise ValueError(
            f"unknown platform {platform!r} for attention_backend={attention_backend!r}"
        )
    if attention_backend == "xla":
        return "xla"
    if platform == "tpu":
        return "pallas_tpu"
    if platform in _GPU_PLATFORMS:
        return "pallas_gpu"
    return "xla" if attention_backend == "auto" else "pallas_gpu"
