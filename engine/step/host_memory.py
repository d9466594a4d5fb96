"""On the CPU, keep the memory a step frees for the next step (EngineConfig.cpu_reuse_freed_memory).

On the CPU the device's memory is the process's heap. XLA:CPU allocates each execution's
temporaries with malloc and frees them when it ends. glibc serves an allocation above its mmap
threshold with a fresh mmap and unmaps it at free. That threshold adapts to freed mmapped chunks,
but only up to 32 MiB on 64-bit systems. So a step whose temporaries are larger maps fresh pages
every step, and the kernel faults and zeroes each 4 KiB page on first touch. The default model's
32-row buckets take 42.4 MiB of temporaries (`Compiled.memory_analysis()`), which is about 10,900
page faults a step.

`reuse_freed_memory` raises glibc's mmap threshold and its trim threshold to REUSE_BYTES
(mallopt). Allocations below that size come from the heap, and up to that much freed memory stays
there for the next step. Measured on this 2-core CPU (BUILD_NOTES.md "Host memory", stop 46): on
the fixed workload at 32 requests, minor page faults fell from 2.7 M to 0.9-1.4 M a run, and the
32-row step's device time by 1.10x in float32 and 1.07x in bfloat16 (medians of three alternated
rounds).

In a thread other than the main one (the server's engine loop), glibc's per-thread arena grows
in heaps of at most 64 MiB. So a block above that, such as the prompt-scoring bucket's 339 MiB, is
still mapped afresh there. A 42 MiB block is reused in a thread as on the main thread.
M_ARENA_MAX=1 would reuse both, at the cost of one malloc lock for every thread; it is not set.

The cost: the process's resident memory stays near its peak (up to REUSE_BYTES freed but kept).
mallopt is process-wide, so the setting applies to everything in the process. It is applied once,
by the first CPU engine built, and never undone. Without glibc (macOS, musl) there is no mallopt:
`None` (the default) then logs that and goes on; `True` raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

REUSE_BYTES = 1 << 30  # both thresholds: above every default bucket's temporaries (339 MiB at most)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_applied: str | None = None


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def reuse_freed_memory(required: bool | None, platform: str) -> str:
    """Applies the setting for an engine on `platform` and says what was done (for the log).
    required: EngineConfig.cpu_reuse_freed_memory (None: where possible; True: raise where not
    possible; False: nothing)."""
    global _applied
    if required is False:  # mallopt cannot be taken back: an earlier engine's setting stays
        if _applied is None:
            return "off"
        logger.warning("jaxserve: cpu_reuse_freed_memory=False, but an earlier engine in this process "
                       "already set it (%s); it stays for the whole process", _applied)
        return f"off, but an earlier engine in this process set it: {_applied}"
    if platform != "cpu":
        return f"not needed on {platform}"
    if _applied is not None:
        return _applied
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(v in os.environ for v in _ENV) or "glibc.malloc.mmap_threshold" in tunables or (
            "glibc.malloc.trim_threshold" in tunables):
        _applied = "left as the environment set it (MALLOC_*_ / GLIBC_TUNABLES)"
        return _applied
    libc = _glibc()
    if libc is None:
        if required:
            raise RuntimeError("EngineConfig.cpu_reuse_freed_memory=True needs glibc's mallopt, which this "
                               "process does not have (macOS, musl); leave it None or set it False")
        _applied = "not available (no glibc mallopt)"
        logger.info("jaxserve: freed host memory is not kept for the next step: %s", _applied)
        return _applied
    for option, name in ((M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD"), (M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD")):
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(REUSE_BYTES)) != 1:
            if required:
                raise RuntimeError(f"EngineConfig.cpu_reuse_freed_memory=True: glibc refused mallopt({name}, "
                                   f"{REUSE_BYTES})")
            _applied = f"not available (glibc refused mallopt({name}))"
            logger.warning("jaxserve: freed host memory is not kept for the next step: %s", _applied)
            return _applied
    _applied = f"glibc mmap and trim thresholds at {REUSE_BYTES >> 20} MiB"
    logger.info("jaxserve: freed host memory kept for the next step (%s)", _applied)
    return _applied
