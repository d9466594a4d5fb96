"""Scan over stacked layers vs the unrolled layer loop: compile time per bucket and step time.

    python -m experiments.bench_layers [--model=random:smollm2-135m --dtypes=float32,bfloat16
                                        --rows=1,8,32 --context=256 --steps=20]

For each dtype and each mode (scan_layers true / false) it builds one engine with buckets
(rows...) and no persistent compilation cache, times the compilation of every bucket, then fills
the batch with `rows` requests of `context` prompt tokens and times decode steps (medians of
`--steps` steps of LLMEngine.step(), the whole step: schedule, inputs, device, update). Modes run
back to back in one process, so their ratio is what to quote. It also reports the 1-row step's
compiled temporary memory (`memory_analysis().temp_size_in_bytes`) against the KV cache's size:
a step that copies the cache shows up there. Output: a markdown table and JSON in
experiments/results/; progress goes to stderr as each measurement ends.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

from absl import app, flags

from experiments import report

_MODEL = flags.DEFINE_string("model", "random:smollm2-135m", "Model spec (same shapes as the default).")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes to measure.")
_ROWS = flags.DEFINE_list("rows", ["1", "8", "32"], "Decode batch sizes (each is a bucket).")
_CONTEXT = flags.DEFINE_integer("context", 256, "Prompt tokens per request before decoding.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed decode steps per batch size.")
_NAME = flags.DEFINE_string("name", "bench_layers", "Result file name under experiments/results/.")


def measure(dtype: str, scan: bool, rows: list[int]) -> dict:
    import jax

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    jax.config.update("jax_compilation_cache_dir", None)  # cold compiles, every time
    buckets = tuple(rows)
    config = EngineConfig(
        model=_MODEL.value, dtype=dtype, scan_layers=scan, max_num_seqs=max(rows),
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
    _log(f"{dtype} scan={scan}: compiled {compile_s}; {smallest.padded_tokens}-token step temp "
         f"{temp_mb:.1f} MB, cache {cache_mb:.1f} MB")
    step_ms = {}
    params = SamplingParams(temperature=0.0, max_tokens=_STEPS.value + 4, ignore_eos=True)
    vocab = engine.runner.sample_vocab_size
    for n in rows:
        for i in range(n):
            prompt = [(31 * i + 7 * k + 1) % vocab for k in range(_CONTEXT.value)]
            engine.add_request(f"r{n}-{i}", prompt, params)
        while any(len(s.request.output_token_ids) == 0 for s in engine._seqs.values()):
            engine.step()  # prefills
        engine.step()  # first decode step: warm
        times = []
        for _ in range(_STEPS.value):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        step_ms[n] = 1000 * statistics.median(times)
        _log(f"{dtype} scan={scan}: {n} rows {step_ms[n]:.1f} ms per step")
        for i in range(n):
            engine.abort_request(f"r{n}-{i}")
    return {"dtype": dtype, "scan_layers": scan, "compile_s": compile_s, "step_ms": step_ms,
            "temp_mb_smallest_bucket": temp_mb, "kv_cache_mb": cache_mb}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv):
    del argv
    rows = [int(r) for r in _ROWS.value]
    results = [measure(dtype, scan, rows) for dtype in _DTYPES.value for scan in (True, False)]
    lines = ["| dtype | layers | compile s per bucket (tokens: s) | " +
             " | ".join(f"step ms, {n} rows" for n in rows) + " | smallest step temp / cache MB |",
             "| --- | --- | --- | " + " | ".join("---" for _ in rows) + " | --- |"]
    for r in results:
        compiles = ", ".join(f"{t}: {s:.1f}" for t, s in r["compile_s"].items())
        steps = " | ".join(f"{r['step_ms'][n]:.1f}" for n in rows)
        lines.append(f"| {r['dtype']} | {'scan' if r['scan_layers'] else 'unrolled'} | {compiles} | {steps} | "
                     f"{r['temp_mb_smallest_bucket']:.0f} / {r['kv_cache_mb']:.0f} |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(__file__).resolve().parent / "results"
    report.write_json(out / f"{_NAME.value}.json", {
        "command": report.command_line(), "model": _MODEL.value, "context": _CONTEXT.value,
        "steps": _STEPS.value, "results": results})
    (out / f"{_NAME.value}.md").write_text(f"# {_NAME.value}\n\n`{report.command_line()}`\n\n{table}\n")


if __name__ == "__main__":
    app.run(main)
