"""The Pallas kernels (GPU and TPU, interpret mode on the CPU) under tensor parallelism: a TP = 2
engine on random:tiny-gqa3 per kernel samples the same tokens as the xla path at TP = 1 (seeded
sampling at a high temperature, so every logit matters). Too slow for the test suite (~25 s per
kernel in interpret mode); run it by hand after touching the shard_map wrapper or a kernel:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m experiments.bench.tp_pallas_check
"""

from __future__ import annotations

from absl import app, flags

flags.DEFINE_list("backends", ["pallas_gpu", "pallas_tpu"], "Kernels to check.")
flags.DEFINE_integer("tp", 2, "Tensor-parallel size.")
FLAGS = flags.FLAGS

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
             num_kv_blocks=40, token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None)


def _run(engine, requests) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def main(argv) -> None:
    import engine.core.builder as builder
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    prompts = [[(5 * k + 3) % 250 + 2 for k in range(n)] for n in (7, 23, 12)]
    requests = [(f"k{i}", p, SamplingParams(temperature=40.0, seed=i, max_tokens=6, ignore_eos=True))
                for i, p in enumerate(prompts)]
    want = _run(LLMEngine(EngineConfig(**KNOBS), progress=False), requests)
    resolve = builder.resolve_backend
    for backend in FLAGS.backends:
        builder.resolve_backend = lambda *args, _backend=backend: _backend  # the CPU would pick pallas_gpu
        try:
            engine = LLMEngine(EngineConfig(**KNOBS, tensor_parallel_size=FLAGS.tp, attention_backend="pallas",
                                            interpret=True), progress=False)
        finally:
            builder.resolve_backend = resolve
        got = _run(engine, requests)
        print(f"{backend} tp={FLAGS.tp}: tokens equal xla tp=1: {got == want}")


if __name__ == "__main__":
    app.run(main)
