"""Trace-time checks of the ragged paged-attention contract, shared by every implementation.

Shapes, split by when they are checked:

  Once per step, in prepare_attention_metadata (the batch):
    seq_lens        int32[S]           kv length of each sequence after this step's tokens are written
    block_tables    int32[S, max_blocks_per_seq]   entries past a sequence's blocks are 0 (null block)
    query_start_loc int32[S + 1]       cumulative query offsets into the token axis
    num_seqs        int32[] or int32[1]  real sequences (a device value)
    and the static sizes num_tokens (T), num_q_heads, num_kv_heads, block_size, head_dim (optional).

  Per layer, in ragged_paged_attention / write_kv (cheap: shapes only, trace time):
    q               [T, num_q_heads, head_dim]                  float (float32 or bfloat16)
    k_cache/v_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim] (stacked, with
                    `layer` a Python int or a traced int32 scalar) or the single-layer
                    [num_blocks, block_size, num_kv_heads, head_dim] (with layer=None); same shape
                    and dtype as each other. That is the "token_major" page; the xla path also
                    takes "head_major" pages, [.., num_blocks, num_kv_heads, block_size, head_dim]
                    (KV_LAYOUTS, `kv_layout_for`).

Every failure is a ValueError naming the argument and the shapes it saw.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

BACKENDS = ("xla", "pallas_gpu", "pallas_tpu")
# How a page holds its tokens' K (or V): "token_major" [block_size, Hkv, D], every backend's;
# "head_major" [Hkv, block_size, D], the xla path's only. The xla path gathers a head's page as
# one contiguous row and multiplies it with no transpose (BUILD_NOTES.md "CPU attention forms",
# head-major pages): the engine allocates that layout for it (`kv_layout_for`).
KV_LAYOUTS = ("token_major", "head_major")


def kv_layout_for(backend: str) -> str:
    """The page layout the engine allocates for `backend`: "head_major" for xla, else "token_major"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return "head_major" if backend == "xla" else "token_major"


def check_kv_layout(kv_layout, backend: str | None = None) -> None:
    """kv_layout must be one of KV_LAYOUTS, and "head_major" is the xla path's (when a backend
    is given)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}; got {kv_layout!r}")
    if kv_layout == "head_major" and backend not in (None, "xla"):
        raise ValueError(f"kv_layout='head_major' is the xla path's page layout; {backend} reads "
                         "token_major pages [num_blocks, block_size, Hkv, D]")


@dataclasses.dataclass(frozen=True)
class BatchShapes:
    """Static sizes of one step's batch (all Python ints; head_dim may be None)."""

    num_tokens: int  # T, padded token count
    num_q_heads: int
    num_kv_heads: int
    head_dim: int | None  # checked against q per call when given
    block_size: int  # tokens per page
    max_num_seqs: int  # S, padded sequence count
    max_blocks_per_seq: int

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class CacheShapes:
    """Static sizes of the KV cache as a stacked [L, num_blocks, block_size, Hkv, D] array
    (token_major; head_major: [L, num_blocks, Hkv, block_size, D])."""

    num_layers: int  # 1 for a single-layer 4-D cache
    num_blocks: int  # pages per layer, block 0 included
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str = "token_major"

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page's [block_size, Hkv, D], or [Hkv, block_size, D] head-major."""
        if self.kv_layout == "head_major":
            return (self.num_kv_heads, self.block_size, self.head_dim)
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, *self.page_shape)


def _shape_str(**arrays) -> str:
    return ", ".join(f"{name}{tuple(np.shape(x))}" for name, x in arrays.items())


def _is_positive_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0


def check_batch_inputs(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    num_tokens,
    num_q_heads,
    num_kv_heads,
    block_size,
    head_dim=None,
) -> BatchShapes:
    """Validates the batch arrays and static sizes; returns BatchShapes or raises ValueError."""
    shapes = _shape_str(
        seq_lens=seq_lens,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        num_seqs=num_seqs,
    )
    sizes = dict(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
    )
    if head_dim is not None:
        sizes["head_dim"] = head_dim
    for name, size in sizes.items():
        if not _is_positive_int(size):
            raise ValueError(f"{name} must be a positive Python int; got {size!r} ({shapes})")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads must be a multiple of num_kv_heads; got num_q_heads={num_q_heads}, "
            f"num_kv_heads={num_kv_heads}"
        )
    for name, x in (
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("num_seqs", num_seqs),
    ):
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(
                f"{name} must be an integer array; got dtype {jnp.result_type(x)} ({shapes})"
            )
    if np.ndim(seq_lens) != 1:
        raise ValueError(f"seq_lens must be [S]; got {shapes}")
    max_num_seqs = np.shape(seq_lens)[0]
    if np.ndim(block_tables) != 2 or np.shape(block_tables)[0] != max_num_seqs:
        raise ValueError(
            f"block_tables must be [S, max_blocks_per_seq] with S=len(seq_lens); got {shapes}"
        )
    if np.shape(query_start_loc) != (max_num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [S + 1] with S=len(seq_lens); got {shapes}")
    if np.shape(num_seqs) not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar of shape [] or [1]; got {shapes}")
    if max_num_seqs == 0 or np.shape(block_tables)[1] == 0:
        raise ValueError(f"S and max_blocks_per_seq must be positive; got {shapes}")
    return BatchShapes(
        num_tokens=int(num_tokens),
        num_q_heads=int(num_q_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=None if head_dim is None else int(head_dim),
        block_size=int(block_size),
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=np.shape(block_tables)[1],
    )


def check_cache(k_cache, v_cache, layer, *, k_name="k_cache", v_name="v_cache",
                eight_bit: bool = False, kv_layout: str = "token_major") -> CacheShapes:
    """Validates a stacked (5-D, with `layer`) or single-layer (4-D, layer=None) K/V cache pair.
    eight_bit: these are the values of an 8-bit cache (int8, or uint8 holding e4m3 bits), whose
    scales kv_quant.check_scaled_pair checks. kv_layout: how the shape's last three axes read
    (KV_LAYOUTS; the caller has checked the name).

    A Python int layer must lie in [0, num_layers); a traced layer must be an integer scalar (its
    range is the caller's promise: the kernels do not bounds-check it).
    """
    shapes = _shape_str(**{k_name: k_cache, v_name: v_cache})
    if np.shape(v_cache) != np.shape(k_cache) or jnp.result_type(v_cache) != jnp.result_type(
        k_cache
    ):
        raise ValueError(
            f"{v_name} must match {k_name} in shape and dtype; got {shapes}, dtypes "
            f"{k_name}={jnp.result_type(k_cache)} {v_name}={jnp.result_type(v_cache)}"
        )
    dtype = jnp.result_type(k_cache)
    if eight_bit:
        if dtype not in (jnp.int8, jnp.uint8):
            raise ValueError(f"the values of an 8-bit {k_name} are int8 or uint8 (e4m3 bits); got {dtype}")
    elif not (jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.uint16):
        raise ValueError(
            f"{k_name} must be floating point (or uint16: the bits of a 16-bit float cache); "
            f"got dtype {dtype} ({shapes})"
        )
    ndim = np.ndim(k_cache)
    page = "num_kv_heads, block_size" if kv_layout == "head_major" else "block_size, num_kv_heads"
    if ndim == 4:
        if layer is not None:
            raise ValueError(
                f"a single-layer {k_name} [num_blocks, {page}, head_dim] takes "
                f"layer=None; got layer={layer!r} ({shapes})"
            )
        return cache_sizes((1, *np.shape(k_cache)), kv_layout)
    if ndim != 5:
        raise ValueError(
            f"{k_name} must be [num_layers, num_blocks, {page}, head_dim] "
            f"(or [num_blocks, {page}, head_dim] with layer=None); got {shapes}"
        )
    num_layers = np.shape(k_cache)[0]
    if layer is None:
        raise ValueError(f"a stacked {k_name} needs layer (an int or int32 scalar); got {shapes}")
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer must be in [0, {num_layers}); got {layer} ({shapes})")
    elif (
        isinstance(layer, bool)
        or np.shape(layer) != ()
        or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)
    ):
        raise ValueError(
            f"layer must be a Python int or an integer scalar array; got {layer!r} ({shapes})"
        )
    return cache_sizes(np.shape(k_cache), kv_layout)


def cache_sizes(shape, kv_layout: str) -> CacheShapes:
    """The sizes of a stacked cache of `shape` [L, num_blocks, page...] in `kv_layout` (no checks)."""
    num_layers, num_blocks, a, b, head_dim = shape
    block_size, heads = (b, a) if kv_layout == "head_major" else (a, b)
    return CacheShapes(num_layers, num_blocks, block_size, heads, head_dim, kv_layout)


def check_bits_values(x, name: str, cache_name: str = "k_cache") -> None:
    """A uint16 cache holds the bits of a 16-bit float cache: what is written to it or read with
    it (k and v, q) must be that 16-bit float type."""
    dtype = jnp.result_type(x)
    if not (jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2):
        raise ValueError(
            f"a uint16 {cache_name} holds the bits of a bfloat16/float16 cache: {name} must be "
            f"bfloat16 or float16; got {dtype}"
        )


def stacked_view(cache, cache_shapes: CacheShapes):
    """The cache as [L, num_blocks, block_size, Hkv, D] (head_major: [L, num_blocks, Hkv,
    block_size, D]): a free reshape (bitcast) of a 4-D cache."""
    return jnp.reshape(cache, cache_shapes.stacked_shape)


def layer_index(layer):
    """0 for layer=None, a Python int stays static, a traced scalar becomes int32[]."""
    if layer is None:
        return 0
    if isinstance(layer, (int, np.integer)):
        return int(layer)
    return jnp.asarray(layer).astype(jnp.int32)


def check_layer_inputs(q, k_cache, v_cache, md, layer, backend, *, eight_bit: bool = False,
                       kv_layout: str = "token_major") -> CacheShapes:
    """Per-layer checks: q and the cache against the metadata; returns the cache's sizes.
    eight_bit: k_cache, v_cache are an 8-bit cache's values (check_cache)."""
    if md.backend != backend:
        raise ValueError(f"md was prepared for backend {md.backend!r}; got backend={backend!r}")
    check_kv_layout(kv_layout, backend)
    cache = check_cache(k_cache, v_cache, layer, eight_bit=eight_bit, kv_layout=kv_layout)
    shapes = _shape_str(q=q, k_cache=k_cache, v_cache=v_cache)
    if jnp.result_type(k_cache) == jnp.uint16 and backend != "xla":
        raise ValueError(f"a uint16 (bits) cache is the xla path's; {backend} takes the float cache ({shapes})")
    if np.ndim(q) != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim]; got {shapes}")
    if not jnp.issubdtype(jnp.result_type(q), jnp.floating):
        raise ValueError(f"q must be floating point; got dtype {jnp.result_type(q)} ({shapes})")
    num_tokens, num_q_heads, head_dim = np.shape(q)
    if (num_tokens, num_q_heads) != (md.num_tokens, md.num_q_heads):
        raise ValueError(
            f"q must be [num_tokens={md.num_tokens}, num_q_heads={md.num_q_heads}, head_dim] as "
            f"the metadata was prepared; got {shapes}"
        )
    if md.head_dim is not None and head_dim != md.head_dim:
        raise ValueError(f"q's head_dim must be the metadata's {md.head_dim}; got {shapes}")
    if cache.head_dim != head_dim:
        raise ValueError(f"q and k_cache disagree on head_dim; got {shapes}")
    if (cache.block_size, cache.num_kv_heads) != (md.block_size, md.num_kv_heads):
        raise ValueError(
            f"k_cache's block_size and num_kv_heads must be the metadata's ({md.block_size}, "
            f"{md.num_kv_heads}); got {shapes}"
        )
    return cache


def check_options(sm_scale, sliding_window, soft_cap, backend) -> None:
    """Validates the static keyword options."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float; got {sm_scale!r}")
    check_sliding_window(sliding_window)
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float; got {soft_cap!r}")


def check_sliding_window(sliding_window) -> None:
    if sliding_window is not None and not _is_positive_int(sliding_window):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")


def check_window_fits(md, sliding_window) -> None:
    """A layer's window must not see pages the metadata's page range skipped.

    Metadata prepared with sliding_window=W reads only pages a W-window needs, so it serves layers
    with a window <= W; metadata prepared with None serves every layer (the mask does the rest).
    """
    if md.sliding_window is None:
        return
    if sliding_window is None or sliding_window > md.sliding_window:
        raise ValueError(
            f"metadata was prepared with sliding_window={md.sliding_window}, which skips pages "
            f"this layer's sliding_window={sliding_window} needs; prepare with "
            "sliding_window=None (or the largest window) for models that mix windows"
        )


def check_tuning(backend, *, block_q, pages_per_step, num_kv_splits) -> None:
    """Validates the optional per-backend overrides of prepare_attention_metadata."""
    for name, value in (
        ("block_q", block_q),
        ("pages_per_step", pages_per_step),
        ("num_kv_splits", num_kv_splits),
    ):
        if value is not None and not _is_positive_int(value):
            raise ValueError(f"{name} must be None or a positive int; got {value!r}")
    if backend == "pallas_gpu":
        # Triton's tensors have power-of-two sizes: block_q x the padded group is the tile's row
        # count, pages_per_step x block_size its kv rows.
        for name, value in (("block_q", block_q), ("pages_per_step", pages_per_step)):
            if value is not None and value & (value - 1):
                raise ValueError(
                    f"pallas_gpu needs a power-of-two {name} (Triton's tile sizes are powers of "
                    f"two); got {name}={value}"
                )
    if pages_per_step is not None and backend == "pallas_tpu":
        raise ValueError("pages_per_step is not a pallas_tpu option (it copies one page a step)")
    if num_kv_splits is not None and backend != "pallas_gpu":
        raise ValueError(f"num_kv_splits is a pallas_gpu option; got backend={backend!r}")
