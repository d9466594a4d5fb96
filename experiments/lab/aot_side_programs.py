"""The programs of a build beside the engine's steps: a draft head's chain (speculative decoding)
and disaggregation's KV gather and scatter, compiled for the target as the engine compiles them.
(A draft model's own runner is built with the target's helpers in aot_build.py.)
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from engine.config import EngineConfig
from engine.step.buckets import RunnerShapes
from engine.step.mesh import replica_meshes
from experiments.lab.aot_results import devices_for, nbytes, tree_bytes_per_device, with_sharding
from models.sharding import kv_cache_spec


def draft_head_programs(cfg, target_params, shapes: RunnerShapes, k: int, *, progress) -> dict:
    """The draft head's chain (engine/spec_decode/draft_head.py DraftHeadProposer: one program per
    sequence bucket over the target's final hidden states), with abstract head weights and the
    target's arrays it reads (embedding, final norm, lm_draft)."""
    from engine.spec_decode.draft_head import draft_head_program

    device = jax.tree.leaves(target_params)[0].sharding
    fn, head, shared = draft_head_program(cfg, target_params, k)
    head = with_sharding(head, jax.tree.map(lambda _: device, head))
    shared = with_sharding(shared, jax.tree.map(lambda _: device, shared))
    hidden = jax.ShapeDtypeStruct((shapes.max_logits, cfg.hidden_size), np.float32, sharding=device)
    programs = []
    for s in shapes.seq_buckets:
        rows = jax.ShapeDtypeStruct((s,), np.int32, sharding=device)
        start = time.perf_counter()
        compiled = fn.lower(head, shared, hidden, rows, rows).compile()
        mem = compiled.memory_analysis()
        programs.append({"program": "draft head", "padded_seqs": s, "compile_s": time.perf_counter() - start,
                         "temp_bytes": int(mem.temp_size_in_bytes) if mem else 0, "error": None})
        if progress:
            progress(f"  draft head S={s:4d}: compiled in {programs[-1]['compile_s']:6.2f} s")
    # lm_draft is the head's own copy (float32 [e, V']); embedding and final norm are the target's.
    own = tree_bytes_per_device(head) + nbytes(shared["lm_draft"]) + nbytes(shared["vocab_map"])
    return {"method": "draft_head", "model": cfg.target or "draft head", "weights_bytes": own,
            "kv_cache_bytes": 0, "table_bytes": 0, "programs": programs}


def transfer_programs(config: EngineConfig, target_name: str, kv_leaf, max_blocks_per_seq: int,
                      kv_layout: str = "token_major") -> list:
    """Disaggregation's KV gather (on the prefill pool) and scatter (on the decode pool, the next
    devices) for every block bucket, compiled like KVGather and KVScatter compile them (the pools'
    caches in `kv_layout`, the runners')."""
    from engine.disaggregation.kv_transfer import block_buckets, gather_blocks, scatter_blocks

    pd = config.disaggregation
    if pd.decode_address is not None:
        raise ValueError("--disaggregation with decode_address: the decode pool is another "
                         "process; compile its programs there (this tool builds one process)")
    more = devices_for(target_name, pd.num_devices)
    pools = []
    for pool in (more[: pd.prefill], more[pd.prefill:]):
        mesh = replica_meshes(len(pool), 1, pool)[0]
        pools.append((NamedSharding(mesh, kv_cache_spec(kv_layout)), NamedSharding(mesh, jax.sharding.PartitionSpec())))
    out = []
    for n in block_buckets(max_blocks_per_seq):
        (src, src_ids), (dst, dst_ids) = pools
        cache = lambda s: jax.ShapeDtypeStruct(kv_leaf.shape, kv_leaf.dtype, sharding=s)  # noqa: E731
        blocks = (kv_leaf.shape[0], n, *kv_leaf.shape[2:])
        moved = jax.ShapeDtypeStruct(blocks, kv_leaf.dtype, sharding=dst)
        for name, jitted, args in (
            ("gather", jax.jit(gather_blocks, out_shardings=(src, src)),
             (cache(src), cache(src), jax.ShapeDtypeStruct((n,), np.int32, sharding=src_ids))),
            ("scatter", jax.jit(scatter_blocks, donate_argnums=(0, 1), out_shardings=(dst, dst)),
             (cache(dst), cache(dst), moved, moved, jax.ShapeDtypeStruct((n,), np.int32, sharding=dst_ids))),
        ):
            start = time.perf_counter()
            jitted.lower(*args).compile()
            out.append({"program": name, "blocks": n, "compile_s": time.perf_counter() - start})
    return out
