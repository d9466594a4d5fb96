"""Paged attention (the `xla` path) against dense attention over a contiguous cache, on the CPU.

    python -m experiments.bench.kernel [--contexts=190,1024 --forms=auto,loop,split --repeats=30 ...]

Both sides compute the same attention for the same batch; only the KV memory layout differs:
  paged  pallas_kernels.prepare_attention_metadata + ragged_paged_attention(backend="xla"): flat
         ragged tokens, pages scattered over a shuffled block pool (a single-layer cache,
         layer=None), a loop over block-table pages with online softmax. "paged ms" times the
         step's metadata plus one layer's call (what one call cost before the metadata was split
         out); "layer ms" one layer's call alone with the metadata prepared outside, what each
         further layer of a model costs.
  dense  each sequence's K/V contiguous in [S, L, Hkv, D] (L = longest context, rounded up to a
         page), one masked softmax attention per group of equal query lengths: decodes as [S, 1],
         prefill chunks as [S, chunk]. That is the best case for dense (no ragged padding).
Shapes: "decode" (decode_seqs sequences, one token each) and "mixed" (the same decodes plus
prefill_seqs chunks of prefill_chunk tokens in one flat batch). Contexts are uniform in
[context / 2, context], one line per context of --contexts. The block tables are
--max_model_len / block_size wide when that is set (what the engine's buckets carry: the longest
context the bucket allows), else the longest context's pages. Forms (--forms, the xla path's,
pallas_kernels/xla_forms.py): "auto" (the bucket's rule), "loop", "split", "loop128" (the loop
form with 128 kv positions a step, the path before the forms), and "native" (the bucket's rule
with its one-token rows in the native CPU kernel, what an engine on the CPU runs; every other
form runs them in the jnp page loop). Times are medians of `repeats`
interleaved runs (every form and dense in turn, a new shuffled order each round) after a warm-up; the ratio form / dense is the
number to watch. A quick run: --repeats=5. --bucket_tokens / --bucket_seqs pad the paged batch as
the engine pads a step to its compiled bucket (T and S columns then show the bucket's; dense
attention stays the real sequences' alone). --kv_layouts: the pages' layout, "head_major" (the
engine's on the xla path, the default), "token_major" or both (a column per form and layout).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels import (
    KV_LAYOUTS,
    kv_layout_for,
    prepare_attention_metadata,
    ragged_paged_attention,
)

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["decode", "mixed"], "Which batches to time: decode, mixed.")
flags.DEFINE_list("contexts", ["1024"], "Longest kv contexts; contexts are uniform in [c/2, c].")
flags.DEFINE_integer("max_model_len", 0, "Block-table width in tokens (0: the longest context).")
flags.DEFINE_list("forms", ["auto", "loop", "split"],
                  "xla forms to time: auto, loop, split, loop128, native, split8 ... split128 (one chunk tier).")
flags.DEFINE_list("kv_layouts", [kv_layout_for("xla")], f"Page layouts to time ({', '.join(KV_LAYOUTS)}).")
flags.DEFINE_integer("decode_seqs", 32, "Decoding sequences (one query token each).")
flags.DEFINE_integer("prefill_seqs", 2, "Prefill chunks in the mixed batch.")
flags.DEFINE_integer("prefill_chunk", 128, "Tokens per prefill chunk in the mixed batch.")
flags.DEFINE_integer("bucket_seqs", 0, "Sequences of the compiled bucket the batch is padded to, as the "
                     "engine pads a step (0: the batch's own count).")
flags.DEFINE_integer("bucket_tokens", 0, "Tokens of the compiled bucket the batch is padded to (0: its own).")
flags.DEFINE_integer("num_q_heads", 9, "Query heads (default: SmolLM2-135M).")
flags.DEFINE_integer("num_kv_heads", 3, "KV heads (default: SmolLM2-135M).")
flags.DEFINE_integer("head_dim", 64, "Head dimension (default: SmolLM2-135M).")
flags.DEFINE_integer("block_size", 16, "Tokens per KV page.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Activation and cache dtype.")
flags.DEFINE_integer("repeats", 30, "Timed runs per implementation.")
flags.DEFINE_integer("seed", 0, "Random seed.")


def make_batch(rng, q_lens, kv_lens, *, hq, hkv, d, block_size, dtype, max_model_len=0):
    """Paged and contiguous copies of the same K/V, plus flat and per-sequence queries; the block
    tables are max(max_model_len, longest context) // block_size pages wide."""
    num_seqs = len(q_lens)
    longest = -(-max(kv_lens) // block_size) * block_size
    k_dense = rng.normal(size=(num_seqs, longest, hkv, d)).astype(np.float32)
    v_dense = rng.normal(size=(num_seqs, longest, hkv, d)).astype(np.float32)
    pages_per_seq = longest // block_size
    num_blocks = 1 + num_seqs * pages_per_seq
    block_ids = 1 + rng.permutation(num_seqs * pages_per_seq)  # shuffled pool, block 0 is null
    block_tables = block_ids.reshape(num_seqs, pages_per_seq).astype(np.int32)
    wide = max(0, -(-max_model_len // block_size) - pages_per_seq)
    k_pages = np.zeros((num_blocks, block_size, hkv, d), np.float32)
    v_pages = np.zeros((num_blocks, block_size, hkv, d), np.float32)
    k_pages[block_tables] = k_dense.reshape(num_seqs, pages_per_seq, block_size, hkv, d)
    v_pages[block_tables] = v_dense.reshape(num_seqs, pages_per_seq, block_size, hkv, d)
    q = rng.normal(size=(sum(q_lens), hq, d)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cast = lambda x: jnp.asarray(x, dtype)
    paged = dict(
        q=cast(q),
        k_cache=cast(k_pages),  # one layer: [num_blocks, block_size, Hkv, D], layer=None
        v_cache=cast(v_pages),
        seq_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(np.pad(block_tables, ((0, 0), (0, wide)))),
        query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.int32(num_seqs),
    )
    # Dense: one group per distinct query length, queries [S_group, q_len, Hq, D].
    groups = []
    for q_len in sorted(set(q_lens)):
        seqs = np.array([s for s, n in enumerate(q_lens) if n == q_len])
        rows = qsl[seqs][:, None] + np.arange(q_len)[None, :]
        groups.append(
            dict(
                q=cast(q[rows]),
                k=cast(k_dense[seqs]),
                v=cast(v_dense[seqs]),
                seq_lens=jnp.asarray(np.asarray(kv_lens)[seqs], jnp.int32),
            )
        )
    return paged, groups


def pad_to_bucket(paged, bucket_tokens: int, bucket_seqs: int):
    """The batch as a bucket of (bucket_tokens, bucket_seqs) carries it: padding tokens (zeros)
    after the real ones, padded sequences with no tokens, no context and null-block tables."""
    T, S = paged["q"].shape[0], paged["seq_lens"].shape[0]
    if 0 < bucket_tokens < T or 0 < bucket_seqs < S:
        raise ValueError(f"a bucket of ({bucket_tokens}, {bucket_seqs}) cannot hold {T} tokens of {S} sequences")
    t, s = max(0, bucket_tokens - T), max(0, bucket_seqs - S)
    qsl = paged["query_start_loc"]
    return dict(paged, q=jnp.pad(paged["q"], ((0, t), (0, 0), (0, 0))),
                seq_lens=jnp.pad(paged["seq_lens"], (0, s)),
                block_tables=jnp.pad(paged["block_tables"], ((0, s), (0, 0))),
                query_start_loc=jnp.pad(qsl, (0, s), constant_values=qsl[-1]))


def dense_attention(q, k, v, seq_lens, *, sm_scale):
    """q [S, Q, Hq, D] over contiguous k, v [S, L, Hkv, D]; causal by position."""
    s_, q_len, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(s_, q_len, hkv, hq // hkv, d)
    logits = jnp.einsum("sqhgd,skhd->sqhgk", qg, k.astype(jnp.float32)) * sm_scale
    q_pos = seq_lens[:, None] - q_len + jnp.arange(q_len)[None, :]  # [S, Q]
    kv_pos = jnp.arange(k.shape[1])
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]
    logits = jnp.where(mask[:, :, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("sqhgk,skhd->sqhgd", probs, v.astype(jnp.float32))
    return out.reshape(s_, q_len, hq, d).astype(q.dtype)


def time_interleaved(fns, repeats):
    """Median seconds of each zero-argument function, runs interleaved in a new shuffled order
    each round (seeded). A fixed order biased the table: the form timed right after dense found
    the machine's caches holding dense's arrays and ran 5-15 % slower than the same compiled form
    timed later in the round (BUILD_NOTES.md "CPU attention forms", stop 44)."""
    for fn in fns:
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    order, rng = list(range(len(fns))), np.random.default_rng(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            fn = fns[i]
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


FORM_OPTIONS = {
    "auto": {},
    "loop": dict(form="loop"),
    "split": dict(form="split"),
    "loop128": dict(form="loop", pages_per_step=0),  # 0: 128 kv positions, set per block size
    # The bucket's form with its one-token rows in the native CPU kernel (pallas_kernels/cpu_native.py);
    # the other forms run them in the jnp page loop.
    "native": dict(rows_kernel="native"),
    # The split form with one tier of c-token prefill chunks (the default: xla_forms'
    # CHUNK_BLOCK_Q-token chunks, each sequence's rest in chunks of CHUNK_TAIL_BLOCK_Q).
    **{f"split{c}": dict(form="split", chunk_block_q=c, chunk_tail_block_q=c) for c in (8, 16, 32, 64, 128)},
}


def batch_shapes(context: int, rng):
    """{name: (q_lens, kv_lens)} of the decode and mixed batches at one context."""
    decode_kv = rng.integers(context // 2, context + 1, FLAGS.decode_seqs).tolist()
    prefill_kv = rng.integers(
        max(context // 2, FLAGS.prefill_chunk), max(context, FLAGS.prefill_chunk) + 1, FLAGS.prefill_seqs
    ).tolist()
    return {
        "decode": ([1] * FLAGS.decode_seqs, decode_kv),
        "mixed": ([1] * FLAGS.decode_seqs + [FLAGS.prefill_chunk] * FLAGS.prefill_seqs,
                  decode_kv + prefill_kv),
    }


def main(argv):
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    dtype = jnp.dtype(FLAGS.dtype)
    sm_scale = FLAGS.head_dim**-0.5
    for form in FLAGS.forms:
        if form not in FORM_OPTIONS:
            raise ValueError(f"--forms takes {sorted(FORM_OPTIONS)}; got {form!r}")
    for kv_layout in FLAGS.kv_layouts:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"--kv_layouts takes {', '.join(KV_LAYOUTS)}; got {kv_layout!r}")
    columns = [(f, lay) for lay in FLAGS.kv_layouts for f in FLAGS.forms]
    label = {c: c[0] if len(FLAGS.kv_layouts) == 1 else f"{c[0]}/{c[1][0]}" for c in columns}

    def prepare(b, form):
        T, hq, d = b["q"].shape
        options = dict(FORM_OPTIONS[form])
        if options.get("pages_per_step") == 0:
            options["pages_per_step"] = max(1, 128 // FLAGS.block_size)
        return prepare_attention_metadata(
            b["seq_lens"],
            b["block_tables"],
            b["query_start_loc"],
            b["num_seqs"],
            num_tokens=T,
            num_q_heads=hq,
            num_kv_heads=FLAGS.num_kv_heads,
            block_size=FLAGS.block_size,
            backend="xla",
            head_dim=d,
            **options,
        )

    def layer(b, md, kv_layout):
        k, v = b["k_cache"], b["v_cache"]
        if kv_layout == "head_major":  # [num_blocks, Hkv, block_size, D] (made outside the timing)
            k, v = b["k_heads"], b["v_heads"]
        return ragged_paged_attention(b["q"], k, v, md, sm_scale=sm_scale, backend="xla", kv_layout=kv_layout)

    prepare_fns = {f: jax.jit(functools.partial(prepare, form=f)) for f in FLAGS.forms}
    layer_fn = jax.jit(layer, static_argnums=2)  # one layer, metadata prepared outside (the form is in md)
    dense_fn = jax.jit(
        lambda groups: [
            dense_attention(g["q"], g["k"], g["v"], g["seq_lens"], sm_scale=sm_scale)
            for g in groups
        ]
    )
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; Hq={FLAGS.num_q_heads} "
        f"Hkv={FLAGS.num_kv_heads} D={FLAGS.head_dim} block_size={FLAGS.block_size} "
        f"dtype={FLAGS.dtype} repeats={FLAGS.repeats} max_model_len={FLAGS.max_model_len}"
    )
    print("per-layer ms (metadata prepared outside); ratio = form / dense")
    print(f"{'shape':8} {'T':>5} {'S':>4} {'max_kv':>7} {'dense':>8} "
          + " ".join(f"{label[c]:>8} {'ratio':>6}" for c in columns))
    for context in (int(c) for c in FLAGS.contexts):
        for name, (q_lens, kv_lens) in batch_shapes(context, rng).items():
            if name not in FLAGS.shapes:
                continue
            paged, groups = make_batch(
                rng, q_lens, kv_lens, hq=FLAGS.num_q_heads, hkv=FLAGS.num_kv_heads,
                d=FLAGS.head_dim, block_size=FLAGS.block_size, dtype=dtype,
                max_model_len=FLAGS.max_model_len,
            )
            real_tokens = len(paged["q"])
            paged = pad_to_bucket(paged, FLAGS.bucket_tokens, FLAGS.bucket_seqs)
            paged.update(k_heads=jnp.swapaxes(paged["k_cache"], 1, 2), v_heads=jnp.swapaxes(paged["v_cache"], 1, 2))
            mds = {f: prepare_fns[f](paged) for f in FLAGS.forms}
            out_dense = jnp.concatenate([o.reshape(-1, *o.shape[2:]) for o in dense_fn(groups)], axis=0)
            for f, lay in columns:  # same answer (dense groups are decodes first, as the batch)
                np.testing.assert_allclose(
                    np.asarray(layer_fn(paged, mds[f], lay), np.float32)[:real_tokens],
                    np.asarray(out_dense, np.float32),
                    atol=2e-2 if FLAGS.dtype == "bfloat16" else 1e-4,
                    err_msg=f"form {f}, {lay} pages",
                )
            times = time_interleaved(
                [functools.partial(dense_fn, groups)]
                + [functools.partial(layer_fn, paged, mds[f], lay) for f, lay in columns],
                FLAGS.repeats,
            )
            dense_s = times[0]
            print(
                f"{name:8} {len(paged['q']):5d} {len(paged['seq_lens']):4d} {max(kv_lens):7d} "
                f"{dense_s * 1e3:8.3f} "
                + " ".join(f"{t * 1e3:8.3f} {t / dense_s:6.2f}" for t in times[1:]),
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
