"""The one public attention op: ragged paged attention over mixed batches, by backend.

Contract (see validation.py for shapes): query token i of sequence s sits at kv position
seq_lens[s] - q_len_s + (i - query_start_loc[s]); it attends causally to kv positions <= its own,
and with sliding_window W only to positions > own - W. Logits are sm_scale * q.k, soft-capped as
soft_cap * tanh(logit / soft_cap) when soft_cap is set. Tokens at index >= query_start_loc[num_seqs]
are padding and get zeros. The output is [T, Hq, D] in q.dtype.
"""

from pallas_kernels import validation
from pallas_kernels.gpu import ragged_paged_attention_gpu
from pallas_kernels.tpu import ragged_paged_attention_tpu
from pallas_kernels.xla import ragged_paged_attention_xla


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "xla",
    interpret: bool = False,
):
    """Dispatches to backend "xla" | "pallas_gpu" | "pallas_tpu" (see resolve_backend).

    interpret=True runs a Pallas kernel in interpret mode (on the CPU); "xla" ignores it.
    Raises ValueError naming the argument and shapes when the inputs break the contract.
    """
    validation.check_options(sm_scale, sliding_window, soft_cap, backend)
    args = (q, k_pages, v_pages, seq_lens, block_tables, query_start_loc, num_seqs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "xla":
        return ragged_paged_attention_xla(*args, **options)
    if backend == "pallas_gpu":
        return ragged_paged_attention_gpu(*args, **options, interpret=interpret)
    return ragged_paged_attention_tpu(*args, **options, interpret=interpret)
