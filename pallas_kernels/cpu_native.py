"""The CPU's native kernel for one-token rows (native/paged_decode.cc), an XLA FFI custom call.

XLA:CPU runs the jnp page loop of the decode rows one op at a time on one core, the pages
gathered into a copy first (BUILD_NOTES.md "CPU attention forms", stop 52: a 32-row float32 step
spent 42 ms of its 123 there). The kernel reads each row's pages in place and spreads the rows
over XLA's intra-op thread pool; the jnp loop (xla.py page_loop) stays the reference it is tested
against and the path wherever the kernel is not built or not asked for.

Built on first use with the machine's C++ compiler (`$CXX`, else c++, g++ or clang++) for this
CPU (-march=native), against the FFI headers of the installed jaxlib, into
~/.cache/jaxserve/native (`$JAXSERVE_NATIVE_DIR`), one library per (source, compiler, target
CPU, jaxlib); later processes load it. Registered once per process as the CPU target
`TARGET`. `available()` says whether it built and loaded, `unavailable_reason()` why not.

    out = decode_rows(q, k_pages, v_pages, tables, start, end, base, scale=..., soft_cap=None,
                      num_blocks=...)
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

TARGET = "jaxserve_paged_decode"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "paged_decode.cc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
PAGE_DTYPES = ("float32", "bfloat16")  # the float caches the kernel reads (a bfloat16 one as its bits)
KV_FORMATS = {"auto": 0, "int8": 1, "fp8_e4m3": 2}  # the kernel's kv_format: float pages, 8-bit caches
BUILD_SECONDS = 120  # the most one compile may take


class NativeUnavailable(RuntimeError):
    """The native kernel could not be built or loaded here; the message says why."""


def build_dir() -> str:
    return os.environ.get("JAXSERVE_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "native")


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeUnavailable("no C++ compiler: set $CXX or install g++ or clang++")


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=BUILD_SECONDS, **kwargs)


def library_path(compiler: str) -> str:
    """Where this source, compiled by `compiler` for this CPU against this jaxlib, is kept: the
    name hashes the source, the compiler's version, the macros -march=native defines (the
    target CPU's features) and the jaxlib version."""
    version = _run([compiler, "--version"]).stdout
    target = _run([compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull]).stdout
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, version.encode(), target.encode(), " ".join(FLAGS).encode(),
                                     jaxlib.__version__.encode()])).hexdigest()[:20]
    return os.path.join(build_dir(), f"paged_decode-{key}.so")


def build(compiler: str, path: str) -> None:
    """Compiles SOURCE into `path` (written beside it, then renamed: concurrent builders never
    leave a half-written library). Raises NativeUnavailable with the compiler's message."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        done = _run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), "-o", tmp, SOURCE])
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} failed on {SOURCE}:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    except subprocess.TimeoutExpired as e:
        raise NativeUnavailable(f"{compiler} took over {BUILD_SECONDS} s on {SOURCE}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _library():
    """(the loaded library, None) or (None, why not); built and registered once per process."""
    try:
        compiler = _compiler()
        path = library_path(compiler)
        if not os.path.exists(path):
            build(compiler, path)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxservePagedDecode), platform="cpu")
        return lib, None
    except (NativeUnavailable, OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"


def available() -> bool:
    """Whether the kernel is built, loaded and registered in this process (building it if not)."""
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel is not available here, or None when it is."""
    return _library()[1]


def require() -> None:
    """Raises NativeUnavailable naming why the kernel cannot run here."""
    if not available():
        raise NativeUnavailable(f"the native CPU attention kernel is unavailable: {unavailable_reason()}")


def reads(dtype, kv_cache_dtype: str, head_major: bool) -> bool:
    """Whether the kernel reads these head-major pages: float32 or bfloat16 ones, or an 8-bit
    cache (int8, fp8_e4m3: kv_quant.ScaledCache)."""
    if not head_major or kv_cache_dtype not in KV_FORMATS:
        return False
    return kv_cache_dtype != "auto" or jnp.dtype(dtype).name in PAGE_DTYPES


def decode_rows(q, k_pages, v_pages, tables, start, end, base, *, scale: float, soft_cap: float | None,
                num_blocks: int, scales=None, kv_cache_dtype: str = "auto"):
    """The kernel's attention of one-token rows (native/paged_decode.cc's contract): q
    f32[NB, Hkv, G, D], k_pages and v_pages [L * num_blocks, Hkv, bs, D] (float32, or bfloat16 or
    its uint16 bits; an 8-bit cache's values with `scales`, its (k, v) scale bits uint16
    [L * num_blocks, Hkv, bs], and its kv_cache_dtype), tables int32[NB, C], start and end
    int32[NB] (the kv positions each row sees), base int32[] (the layer's first page). Returns
    f32[NB, Hkv, G, D]."""
    require()
    if kv_cache_dtype not in KV_FORMATS or (scales is None) != (kv_cache_dtype == "auto"):
        raise ValueError(f"decode_rows reads float pages (kv_cache_dtype 'auto', no scales) or an 8-bit cache "
                         f"(int8, fp8_e4m3, with scales); got kv_cache_dtype={kv_cache_dtype!r}, "
                         f"scales {'given' if scales is not None else 'none'}")
    k_scales, v_scales = scales if scales is not None else (jnp.zeros((0,), jnp.uint16),) * 2
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_pages, v_pages, k_scales, v_scales, tables.astype(jnp.int32),
                start.astype(jnp.int32), end.astype(jnp.int32), jnp.asarray(base, jnp.int32),
                scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0), num_blocks=np.int64(num_blocks),
                kv_format=np.int64(KV_FORMATS[kv_cache_dtype]))
