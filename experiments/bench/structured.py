"""The cost of structured output: throughput of a batch where half the requests are constrained by
a JSON schema against the same batch unconstrained, and the host time spent filling token masks.

    python -m experiments.bench.structured                # 32 requests, 16 constrained, default model

Both arms run the same prompts, temperature 1, ignore_eos and the same max_tokens; the schema (an
object holding an array of at least 64 integers) keeps every constrained request generating to
max_tokens, so both arms generate the same number of tokens and their throughputs compare
directly. A warm-up run compiles nothing new afterwards (checked). Arms alternate over
`--repeats` and the median is reported, with the load average (the CPU may be shared).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "default", "model spec")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "concurrent requests per arm")
_CONSTRAINED_FRACTION = flags.DEFINE_float("constrained_fraction", 0.5, "share of requests with a JSON schema")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "tokens generated per request")
_REPEATS = flags.DEFINE_integer("repeats", 1, "runs per arm (alternating); the median is reported")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget per step")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["32", "64", "256"], "token buckets")
_RESULT_JSON = flags.DEFINE_string("result_json", "experiments/results/structured_output.json", "where to write")

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "minItems": 64,
          "items": {"type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["values"],
          "additionalProperties": False}


def _run_arm(llm, prompts, params) -> dict:
    engine = llm.engine
    builder = engine.runner.builder
    before = engine.get_stats()
    mask_seconds, mask_steps = builder.mask_seconds, builder.num_mask_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.num_steps - before.num_steps
    num_mask_steps = builder.num_mask_steps - mask_steps
    fill = builder.mask_seconds - mask_seconds
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "steps": steps,
            "ms_per_step": 1000 * seconds / steps, "mask_fill_ms_per_step": 1000 * fill / max(num_mask_steps, 1),
            "mask_fill_share": fill / seconds, "compilations": after.num_compilations - before.num_compilations}


def main(argv) -> None:
    del argv
    from engine import LLM, SamplingParams
    from engine.structured_params import StructuredOutputsParams

    n = _NUM_REQUESTS.value
    load_start = os.getloadavg()
    llm = LLM(_MODEL.value, max_num_seqs=n, max_num_batched_tokens=_MAX_BATCHED.value, max_model_len=512,
              token_buckets=tuple(int(t) for t in _TOKEN_BUCKETS.value), seq_buckets=(n,), progress=False)
    prompts = [f"Write a JSON object listing numbers (request {i}):\n" for i in range(n)]
    num_constrained = int(round(n * _CONSTRAINED_FRACTION.value))
    schema = StructuredOutputsParams(json=SCHEMA)

    def params(constrained: bool):
        return [SamplingParams(temperature=1.0, max_tokens=_MAX_TOKENS.value, seed=i, ignore_eos=True,
                               structured_outputs=schema if constrained and i < num_constrained else None)
                for i in range(n)]

    llm.generate(prompts, params(True), use_tqdm=False)  # warm-up: compiles, the grammar LRU fills
    arms: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for _ in range(_REPEATS.value):
        arms["unconstrained"].append(_run_arm(llm, prompts, params(False)))
        arms["constrained"].append(_run_arm(llm, prompts, params(True)))
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in arms.items()}
    ratio = summary["constrained"]["tokens_per_s"] / summary["unconstrained"]["tokens_per_s"]
    layout = next(iter(llm.engine.runner.builder._layouts.values()))
    result = {
        "command": "python -m experiments.bench.structured " + " ".join(
            f"--{k}={v}" for k, v in (("num_requests", n), ("max_tokens", _MAX_TOKENS.value),
                                      ("repeats", _REPEATS.value))),
        "num_requests": n, "num_constrained": num_constrained, "max_tokens": _MAX_TOKENS.value,
        "arms": summary, "runs": arms, "throughput_ratio": ratio,
        "step_buffer_bytes": int(layout.size * 4),
        "mask_bytes_when_constrained": int(layout.mask.nbytes),
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "goals": [{"goal": "constrained throughput >= 0.9x unconstrained", "met": bool(ratio >= 0.9)},
                  {"goal": "nothing recompiles after warm-up",
                   "met": all(r["compilations"] == 0 for runs in arms.values() for r in runs)}],
    }
    path = pathlib.Path(_RESULT_JSON.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    for name, s in summary.items():
        print(f"{name:>13}: {s['tokens_per_s']:.1f} tok/s, {s['ms_per_step']:.1f} ms/step, mask fill "
              f"{s['mask_fill_ms_per_step']:.2f} ms/step ({100 * s['mask_fill_share']:.1f} % of the time), "
              f"{s['compilations']} compilations")
    print(f"throughput ratio {ratio:.3f}; step buffer {result['step_buffer_bytes']} bytes of which mask "
          f"{result['mask_bytes']}; load average {load_start} -> {result['load_average_end']}")


if __name__ == "__main__":
    app.run(main)
