"""Offline throughput: the engine with continuous batching against the same engine one request at a
time, on ShareGPT prompts and output lengths, measured in one run.

    python -m experiments.bench_offline --num_prompts=200 --num_sequential=24

1. Load `num_prompts` ShareGPT conversations (prompt text, and the length of the reply as
   max_tokens, capped by --max_output_len; ignore_eos so every request produces exactly that).
2. Build one engine (start-up compile time is reported), warm it up on one request.
3. Batched arm: every request is added at once; output tokens per second over the whole run.
4. Sequential arm: the same engine with max_num_seqs=1 (a scheduler swap; the compiled steps are
   the same) on the first `num_sequential` requests: the one-at-a-time rate. A full 200-request
   sequential run would take hours on a 2-core CPU, and a rate over a prefix of the same mix is
   the comparable quantity.
5. Report both rates, their ratio, the share of padded tokens per step, and write JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags

_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 200, "requests in the batched arm")
_NUM_SEQUENTIAL = flags.DEFINE_integer("num_sequential", 24, "requests in the one-at-a-time arm (a prefix)")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 256, "drop ShareGPT prompts longer than this")
_MAX_OUTPUT_LEN = flags.DEFINE_integer("max_output_len", 64, "cap on each reply's length")
_MODEL = flags.DEFINE_string("model", "default", "model spec")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "batched arm's max_num_seqs")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget per step")
_RESULT_JSON = flags.DEFINE_string("result_json", "experiments/results/bench_offline.json", "where to write")


def run_arm(engine, samples, params_for) -> dict:
    """Adds every sample at once and steps until done; returns tokens, seconds and steps."""
    start_steps = engine.get_stats().num_steps
    start = time.perf_counter()
    for i, (ids, max_tokens) in enumerate(samples):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", ids, params_for(max_tokens))
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"requests": len(samples), "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds, "steps": engine.get_stats().num_steps - start_steps}


def main(argv) -> None:
    del argv
    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine
    from experiments.datasets import DatasetOptions, build_samples

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=_MODEL.value, max_num_seqs=_MAX_NUM_SEQS.value,
        max_num_batched_tokens=_MAX_BATCHED.value, max_model_len=1024,
        # A 1-token bucket keeps the one-at-a-time arm honest: on the CPU a step costs what its
        # padded token count costs, so padding a lone decode to 8 tokens would slow the baseline.
        token_buckets=(1, 8, 32, 64, 128, _MAX_BATCHED.value), seq_buckets=(1, 8, _MAX_NUM_SEQS.value)))
    startup = time.perf_counter() - t0
    options = DatasetOptions(dataset="sharegpt", num_prompts=_NUM_PROMPTS.value,
                             max_prompt_len=_MAX_PROMPT_LEN.value, max_output_len=_MAX_OUTPUT_LEN.value,
                             sharegpt_max_total_len=1000)
    raw = build_samples(options, engine.tokenizer)
    samples = [(engine.tokenizer.encode(s.prompt, add_special_tokens=False), s.expected_output_len)
               for s in raw]
    params_for = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    run_arm(engine, samples[:1], params_for)  # warm-up: first-touch costs out of the measurement
    compiles_before = engine.get_stats().num_compilations
    padded_before = (engine.runner.num_padded_tokens, engine.runner.num_real_tokens)
    batched = run_arm(engine, samples, params_for)
    pad = engine.runner.num_padded_tokens - padded_before[0]
    real = engine.runner.num_real_tokens - padded_before[1]
    batched["padded_token_share"] = pad / (pad + real)
    engine.reconfigure_scheduler(max_num_seqs=1)
    sequential = run_arm(engine, samples[: _NUM_SEQUENTIAL.value], params_for)
    engine.reconfigure_scheduler(max_num_seqs=_MAX_NUM_SEQS.value)
    result = {
        "command": "python -m experiments.bench_offline " + " ".join(
            f"--{f}={flags.FLAGS[f].value}" for f in ("num_prompts", "num_sequential", "max_prompt_len",
                                                      "max_output_len", "max_num_seqs", "max_num_batched_tokens")),
        "model": engine.model_name, "dtype": engine.dtype, "platform": _platform(),
        "startup_seconds": startup, "load_seconds": engine.load_seconds,
        "compile_seconds": engine.compile_seconds, "buckets": [dataclasses.astuple(b) for b in engine.runner.shapes.buckets()],
        "mean_prompt_len": sum(len(s[0]) for s in samples) / len(samples),
        "mean_output_len": sum(s[1] for s in samples) / len(samples),
        "batched": batched, "sequential": sequential,
        "speedup": batched["output_tokens_per_s"] / sequential["output_tokens_per_s"],
        "compilations_during_runs": engine.get_stats().num_compilations - compiles_before,
    }
    print(f"model {result['model']} ({result['dtype']}, {result['platform']}); start-up {startup:.1f}s "
          f"(load {engine.load_seconds:.1f}s, compile {engine.compile_seconds:.1f}s, buckets {result['buckets']})")
    print(f"prompts: mean {result['mean_prompt_len']:.0f} tokens, outputs mean {result['mean_output_len']:.0f} tokens")
    for name in ("batched", "sequential"):
        r = result[name]
        print(f"{name:>10}: {r['requests']:4d} requests, {r['output_tokens']:6d} tokens in {r['seconds']:7.1f}s "
              f"= {r['output_tokens_per_s']:7.1f} tok/s over {r['steps']} steps")
    print(f"speedup {result['speedup']:.2f}x; padded token share (batched) {batched['padded_token_share']:.1%}; "
          f"compilations during the runs: {result['compilations_during_runs']}")
    os.makedirs(os.path.dirname(_RESULT_JSON.value) or ".", exist_ok=True)
    with open(_RESULT_JSON.value, "w") as f:
        json.dump(result, f, indent=1)


def _platform() -> str:
    import jax

    return jax.devices()[0].platform


if __name__ == "__main__":
    app.run(main)
