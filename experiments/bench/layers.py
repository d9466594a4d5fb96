"""The layer loops side by side: compile time per bucket and decode step time.

    python -m experiments.bench.layers [--model=random:smollm2-135m --dtypes=float32,bfloat16
                                        --loops=stacked,switch,unrolled --rows=1,8,32
                                        --context=128 --steps=15]

The loops (engine/config.py resolve_layer_loop): "stacked" (scan_layers with weights stacked on a
layer axis, a lax.scan over them), "switch" (scan_layers with per-layer weight buffers picked by
lax.switch inside a lax.scan over the layer index), "unrolled" (scan_layers=False).
For each dtype it builds one engine per loop with buckets (rows..., context) and no persistent
compilation cache, timing the compilation of every bucket. Then, for each row count, it fills
every engine's batch with `rows` requests of `context` prompt tokens and times decode steps
(LLMEngine.step(), the whole step: schedule, inputs, device, update), the engines taking turns
step by step, so a slow phase of a shared machine hits every loop alike: medians of `--steps`
steps per engine. It also reports the smallest step's compiled temporary memory against the KV
cache's size (a step that copies the cache shows up there). Output: a markdown table and JSON
in experiments/results/; progress goes to stderr as each measurement ends.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

from absl import app, flags

from experiments.lab import report

_MODEL = flags.DEFINE_string("model", "random:smollm2-135m", "Model spec (same shapes as the default).")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes to measure.")
_LOOPS = flags.DEFINE_list("loops", ["stacked", "switch", "unrolled"], "layer loops to compare.")
_ROWS = flags.DEFINE_list("rows", ["1", "8", "32"], "Decode batch sizes (each is a bucket).")
_CONTEXT = flags.DEFINE_integer("context", 128, "Prompt tokens per request before decoding.")
_STEPS = flags.DEFINE_integer("steps", 15, "Timed decode steps per batch size and loop.")
_NAME = flags.DEFINE_string("name", "bench_layers", "Result file name under experiments/results/.")

LOOP_KNOBS = {"stacked": dict(scan_layers=True, stack_layer_weights=True),
              "switch": dict(scan_layers=True, stack_layer_weights=False),
              "unrolled": dict(scan_layers=False)}


def build(dtype: str, loop: str, rows: list[int]):
    import jax

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    jax.config.update("jax_compilation_cache_dir", None)  # cold compiles, every time
    buckets = tuple(rows)
    config = EngineConfig(
        model=_MODEL.value, dtype=dtype, max_num_seqs=max(rows), **LOOP_KNOBS[loop],
        max_num_batched_tokens=max(max(rows), _CONTEXT.value), max_model_len=_CONTEXT.value + 64,
        token_buckets=tuple(sorted(set(buckets + (_CONTEXT.value,)))), seq_buckets=buckets,
        enable_prefix_caching=False, compilation_cache_dir=None, precompile=False)
    engine = LLMEngine(config, progress=False)
    compile_s = {}
    for bucket in engine.runner.shapes.buckets():
        t0 = time.perf_counter()
        engine.runner._executable(bucket)
        compile_s[bucket.padded_tokens] = time.perf_counter() - t0
    smallest = engine.runner.shapes.buckets()[0]
    temp_mb = engine.runner._executable(smallest).memory_analysis().temp_size_in_bytes / 1e6
    cache_mb = sum(x.nbytes for x in engine.runner.kv_cache) / 1e6
    _log(f"{dtype} {loop}: compiled {compile_s}; {smallest.padded_tokens}-token step temp "
         f"{temp_mb:.1f} MB, cache {cache_mb:.1f} MB")
    return engine, {"dtype": dtype, "loop": loop, "compile_s": compile_s, "step_ms": {},
                    "temp_mb_smallest_bucket": temp_mb, "kv_cache_mb": cache_mb}


def measure_steps(engines: dict, results: dict, rows: list[int]) -> None:
    """Fills every engine with n decoding requests, then steps them in turn."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_STEPS.value + 4, ignore_eos=True)
    for n in rows:
        for engine in engines.values():
            vocab = engine.runner.sample_vocab_size
            for i in range(n):
                prompt = [(31 * i + 7 * k + 1) % vocab for k in range(_CONTEXT.value)]
                engine.add_request(f"r{n}-{i}", prompt, params)
            while any(len(s.request.output_token_ids) == 0 for s in engine._seqs.values()):
                engine.step()  # prefills
            engine.step()  # first decode step: warm
        times = {loop: [] for loop in engines}
        for _ in range(_STEPS.value):
            for loop, engine in engines.items():
                t0 = time.perf_counter()
                engine.step()
                times[loop].append(time.perf_counter() - t0)
        for loop, engine in engines.items():
            results[loop]["step_ms"][n] = 1000 * statistics.median(times[loop])
            for i in range(n):
                engine.abort_request(f"r{n}-{i}")
        _log(f"{n} rows: " + ", ".join(f"{loop} {results[loop]['step_ms'][n]:.1f} ms" for loop in engines))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv):
    del argv
    rows = [int(r) for r in _ROWS.value]
    unknown = sorted(set(_LOOPS.value) - set(LOOP_KNOBS))
    if unknown:
        raise app.UsageError(f"--loops: unknown {unknown}; known: {sorted(LOOP_KNOBS)}")
    results = []
    for dtype in _DTYPES.value:
        engines, by_loop = {}, {}
        for loop in _LOOPS.value:
            engines[loop], by_loop[loop] = build(dtype, loop, rows)
        measure_steps(engines, by_loop, rows)
        results.extend(by_loop.values())
        del engines
    lines = ["| dtype | layers | compile s per bucket (tokens: s) | " +
             " | ".join(f"step ms, {n} rows" for n in rows) + " | smallest step temp / cache MB |",
             "| --- | --- | --- | " + " | ".join("---" for _ in rows) + " | --- |"]
    for r in results:
        compiles = ", ".join(f"{t}: {s:.1f}" for t, s in r["compile_s"].items())
        steps = " | ".join(f"{r['step_ms'][n]:.1f}" for n in rows)
        lines.append(f"| {r['dtype']} | {r['loop']} | {compiles} | {steps} | "
                     f"{r['temp_mb_smallest_bucket']:.0f} / {r['kv_cache_mb']:.0f} |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(__file__).resolve().parents[1] / "results"
    report.write_json(out / f"{_NAME.value}.json", {
        "command": report.command_line(), "model": _MODEL.value, "context": _CONTEXT.value,
        "steps": _STEPS.value, "results": results})
    (out / f"{_NAME.value}.md").write_text(f"# {_NAME.value}\n\n`{report.command_line()}`\n\n{table}\n")


if __name__ == "__main__":
    app.run(main)
