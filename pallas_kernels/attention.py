"""The public attention ops: per-step metadata, then one ragged paged-attention call per layer.

Contract (see validation.py for shapes): query token i of sequence s sits at kv position
seq_lens[s] - q_len_s + (i - query_start_loc[s]); it attends causally to kv positions <= its own,
and with sliding_window W only to positions > own - W. Logits are sm_scale * q.k, soft-capped as
soft_cap * tanh(logit / soft_cap) when soft_cap is set. Tokens at index >= query_start_loc[num_seqs]
are padding and get zeros. The output is [T, Hq, D] in q.dtype.

A step of an L-layer model:

    md = prepare_attention_metadata(seq_lens, block_tables, query_start_loc, num_seqs,
                                    num_tokens=T, num_q_heads=Hq, num_kv_heads=Hkv,
                                    block_size=bs, backend=backend)     # once, in the step's jit
    for layer in range(L):          # or the body of a lax.scan over layers (layer traced)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slot_mapping, layer=layer)
        out = ragged_paged_attention(q, k_cache, v_cache, md, layer=layer, sm_scale=...,
                                     backend=backend)

with k_cache, v_cache [L, num_blocks, block_size, Hkv, D]: every layer reads its pages in place.
"""

from pallas_kernels import metadata, validation
from pallas_kernels.gpu import prepare_gpu, ragged_paged_attention_gpu
from pallas_kernels.tpu import prepare_tpu, ragged_paged_attention_tpu
from pallas_kernels.xla_forms import prepare_xla, ragged_paged_attention_xla

AttentionMetadata = metadata.AttentionMetadata


def prepare_attention_metadata(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    backend: str,
    sliding_window: int | None = None,
    head_dim: int | None = None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_kv_splits: int | None = None,
    form: str | None = None,
    chunk_block_q: int | None = None,
    chunk_tail_block_q: int | None = None,
    rows_kernel: str | None = None,
) -> AttentionMetadata:
    """The step's AttentionMetadata for `backend`: everything that depends only on the batch.

    Call it once per step inside the step's jit and pass the result to every layer. With
    sliding_window=W the page ranges skip pages a W-window never sees, so the metadata serves
    layers whose window is <= W; a model that mixes windowed and full layers prepares with None
    (or prepares once per kind). head_dim, when given, is checked against q on every call.
    block_q, pages_per_step (xla, pallas_gpu) and num_kv_splits (pallas_gpu) override the
    backend's static choices; None lets the backend choose. form ("loop" | "split", xla only)
    overrides the xla path's per-bucket choice of attention form (xla_forms.py), rows_kernel ("jnp" |
    "native", xla only) how its one-token rows run (None: the xla_forms.rows_kernel context's). Raises ValueError naming the argument
    and shapes when the inputs break the contract.
    """
    if backend not in validation.BACKENDS:
        raise ValueError(f"backend must be one of {validation.BACKENDS}; got {backend!r}")
    validation.check_sliding_window(sliding_window)
    split_options = (("chunk_block_q", chunk_block_q), ("chunk_tail_block_q", chunk_tail_block_q))
    for name, value in (("form", form), ("rows_kernel", rows_kernel), *split_options):
        if value is not None and backend != "xla":
            raise ValueError(f"{name} is an xla option; got {name}={value!r}, backend={backend!r}")
    for name, value in split_options:
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or a positive int; got {value!r}")
    validation.check_tuning(
        backend, block_q=block_q, pages_per_step=pages_per_step, num_kv_splits=num_kv_splits
    )
    shapes = validation.check_batch_inputs(
        seq_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
    )
    args = (seq_lens, block_tables, query_start_loc, num_seqs, shapes)
    if backend == "xla":
        return prepare_xla(
            *args,
            sliding_window=sliding_window,
            block_q=block_q,
            pages_per_step=pages_per_step,
            form=form,
            chunk_block_q=chunk_block_q,
            chunk_tail_block_q=chunk_tail_block_q,
            rows_kernel=rows_kernel,
        )
    if backend == "pallas_gpu":
        return prepare_gpu(
            *args,
            sliding_window=sliding_window,
            block_q=block_q,
            pages_per_step=pages_per_step,
            num_kv_splits=num_kv_splits,
        )
    return prepare_tpu(*args, sliding_window=sliding_window, block_q=block_q)


def ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    *,
    layer=None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "xla",
    interpret: bool = False,
    kv_layout: str = "token_major",
):
    """One layer's attention, dispatched to backend "xla" | "pallas_gpu" | "pallas_tpu".

    q [T, Hq, D]; k_cache, v_cache [L, num_blocks, block_size, Hkv, D] with layer a Python int or
    a traced int32 scalar in [0, L) (read in place, never sliced out), or the single-layer
    [num_blocks, block_size, Hkv, D] with layer=None; an 8-bit cache is a kv_quant.ScaledCache
    each (values of those shapes, scales without D), read by every backend. kv_layout
    "head_major" (xla only): pages [Hkv, block_size, D] instead (validation.KV_LAYOUTS). md comes from
    prepare_attention_metadata with the same backend. interpret=True runs a Pallas kernel in interpret mode (on the CPU);
    "xla" ignores it. Raises ValueError naming the argument and shapes when the inputs break the
    contract. Returns [T, Hq, D] in q.dtype.
    """
    validation.check_options(sm_scale, sliding_window, soft_cap, backend)
    validation.check_kv_layout(kv_layout, backend)
    options = dict(layer=layer, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (q, k_cache, v_cache, md)
    if backend == "xla":
        return ragged_paged_attention_xla(*args, **options, kv_layout=kv_layout)
    if backend == "pallas_gpu":
        return ragged_paged_attention_gpu(*args, **options, interpret=interpret)
    return ragged_paged_attention_tpu(*args, **options, interpret=interpret)
