"""What tensor parallelism costs and saves, per TP size: weight and KV bytes per device (from the
arrays' shards), the head padding, and the collectives of one compiled step (from its HLO).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m experiments.lab.tp_report --model=default --tp=1,2,4

Bytes and collectives are exact on any platform; no time is measured here (CPU times say nothing
about an accelerator: measure speed with experiments.bench.offline on one).
"""

from __future__ import annotations

import collections
import re

from absl import app, flags

flags.DEFINE_string("model", "default", "Model to load.")
flags.DEFINE_list("tp", ["1", "2", "4"], "Tensor-parallel sizes.")
flags.DEFINE_integer("block_size", 16, "KV block size.")
FLAGS = flags.FLAGS

_COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(")


def collectives(hlo: str) -> dict[str, int]:
    """{"entry all-reduce": n, "loop body all-reduce": n, ...} for a compiled module's text."""
    counts: collections.Counter = collections.Counter()
    where = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            where = "entry" if line.startswith("ENTRY") else "loop body"
        m = _COLLECTIVE.search(line)
        if m:
            counts[f"{where} {m.group(1)}"] += 1
    return dict(counts)


def main(argv) -> None:
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from models.loader import load_model

    loaded = load_model(FLAGS.model, host=True, progress=False)
    base = None
    for tp in map(int, FLAGS.tp):
        engine = LLMEngine(EngineConfig(model=FLAGS.model, tensor_parallel_size=tp, max_num_seqs=4,
                                        max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=9,
                                        block_size=FLAGS.block_size, token_buckets=(16,), seq_buckets=(4,),
                                        compilation_cache_dir=None), progress=False, loaded=loaded)
        stats = engine.get_stats()
        weights, kv = max(stats.weight_bytes_per_device), max(stats.kv_cache_bytes_per_device)
        base = base or (weights, kv)
        heads = (engine.placement.layout.num_heads, engine.placement.layout.num_kv_heads) if engine.placement else (
            engine.model_config.num_heads, engine.model_config.num_kv_heads)
        hlo = next(iter(engine.runner._compiled.values())).as_text()
        print(f"tp={tp}: heads q/kv {heads[0]}/{heads[1]}; weights/device {weights / 2**20:.1f} MiB "
              f"({weights / base[0]:.3f} of tp=1); KV/device {kv / 2**20:.2f} MiB ({kv / base[1]:.3f} of tp=1); "
              f"collectives {collectives(hlo)}")


if __name__ == "__main__":
    app.run(main)
