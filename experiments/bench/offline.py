"""Offline throughput, two workloads, measured in one run.

    python -m experiments.bench.offline --num_prompts=200 --num_sequential=24
    python -m experiments.bench.offline --dataset=fixed --num_requests=1,8,32 --output_len=128 \\
        --dtypes=float32,bfloat16 [--profile]

`--dataset=sharegpt` (the default): the engine with continuous batching against the same engine
one request at a time, on ShareGPT prompts and output lengths.
1. Load `num_prompts` ShareGPT conversations (prompt text, and the length of the reply as
   max_tokens, capped by --max_output_len; ignore_eos so every request produces exactly that).
2. Build one engine (start-up compile time is reported), warm it up on one request.
3. Batched arm: every request is added at once; output tokens per second over the whole run.
4. Sequential arm: the same engine with max_num_seqs=1 (a scheduler swap; the compiled steps are
   the same) on the first `num_sequential` requests: the one-at-a-time rate. A full 200-request
   sequential run would take hours on a 2-core CPU, and a rate over a prefix of the same mix is
   the comparable quantity.
5. Report both rates, their ratio, the share of padded tokens per step, and write JSON.

`--dataset=fixed`: 4 short chat prompts (37-40 tokens, FIXED_QUESTIONS) cycled to N requests,
`--output_len` new tokens each, greedy, ignore_eos, all N submitted at once to `LLM.generate`;
for every N and dtype the median output tokens/s of `--repeats` runs. The engines of all dtypes
are built first and the runs interleave (N, repeat, dtype), so the dtypes share the machine's
conditions. `--prompt_len=P` (> 0) cuts or repeats each prompt's ids to exactly P tokens.
`--profile` adds the per-bucket step profile (experiments/lab/step_profiler.py) of one more run per N;
`--op_profile` with it traces that run and splits its device time by op class (op_profile.py).
`--dataset=random`: `--num_prompts` prompts of `--prompt_len` random token ids (128 when 0), each
generating `--output_len` tokens (greedy, ignore_eos), all added at once to an engine of
`--max_num_seqs` rows: with --max_num_seqs=16 a closed loop of 16 clients, vLLM's random 128/64
(the prompts' prefill chunks enter beside the running decodes as requests finish). One timed
run, then with --profile one profiled run.
`--expert_load` (a mixture of experts, e.g. --model=random:small-moe) builds a second engine whose
steps report each MoE layer's assignments per expert (models/moe.ExpertLoadRecorder; the timed
engine has no such callback) and adds one run per N on it, with N distinct random-token prompts
of the fixed prompts' lengths (copies would route alike): the load imbalance per step (max expert
load / mean) and over the run, experiments/bench/expert_load.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from absl import app, flags

_DATASET = flags.DEFINE_enum("dataset", "sharegpt", ["sharegpt", "fixed", "random"], "workload")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 200, "sharegpt: requests in the batched arm")
_NUM_SEQUENTIAL = flags.DEFINE_integer("num_sequential", 24, "sharegpt: requests in the one-at-a-time arm (a prefix)")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 256, "sharegpt: drop prompts longer than this")
_MAX_OUTPUT_LEN = flags.DEFINE_integer("max_output_len", 64, "sharegpt: cap on each reply's length")
_NUM_REQUESTS = flags.DEFINE_list("num_requests", ["1", "8", "32"], "fixed: request counts N")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 0, "fixed: 0 = the chat prompts as rendered")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 128, "fixed: new tokens per request")
_REPEATS = flags.DEFINE_integer("repeats", 3, "fixed: runs per (N, dtype); the median is reported")
_DTYPES = flags.DEFINE_list("dtypes", [], "fixed: dtypes to compare (default: the platform's); an entry "
                            "DTYPE:QUANTIZATION[:KV_CACHE_DTYPE[:SMOOTHING]] quantizes too, e.g. float32:int8, "
                            "float32:int8:int8, float32::int8, float32:int8::off, float32:gguf (a GGUF's own "
                            "blocks) (EngineConfig.quantization, kv_cache_dtype, quantization_smoothing)")
_PROFILE = flags.DEFINE_boolean("profile", False, "also print the per-bucket step profile")
_OP_PROFILE = flags.DEFINE_boolean("op_profile", False, "with --profile: also trace the profiled run and print "
                                   "its device time by op class (experiments/lab/op_profile.py)")
_EXPERT_LOAD = flags.DEFINE_boolean("expert_load", False, "fixed, a mixture of experts: also one run per N on "
                                    "an engine recording each step's expert loads (experiments/bench/expert_load.py)")
_MODEL = flags.DEFINE_string("model", "default", "model spec")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "max_num_seqs (batched arm / largest N)")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget per step")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", [], "token buckets (default: 1,8,32,64,128,budget)")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", [], "sequence buckets (default: 1,8,max_num_seqs)")
_RESULT_JSON = flags.DEFINE_string("result_json", "", "where to write (default: experiments/results/bench_offline[_fixed].json)")

# Short chat questions: rendered with SmolLM2's template they are 37, 38, 39 and 40 tokens.
FIXED_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me a tip for learning to cook.",
    "Explain in one short sentence how a rainbow forms.",
)


def build_llm(dtype: str | None, *, max_num_seqs: int | None = None):
    """dtype: a dtype, or DTYPE:QUANTIZATION[:KV_CACHE_DTYPE[:SMOOTHING]] (see --dtypes)."""
    from engine import LLM

    dtype, quantization, kv_cache_dtype, smoothing = ((dtype or "").split(":") + ["", "", ""])[:4]
    quant = dict(quantization=quantization or None, kv_cache_dtype=kv_cache_dtype or "auto",
                 quantization_smoothing=smoothing or None)

    seqs = max_num_seqs or _MAX_NUM_SEQS.value
    budget = _MAX_BATCHED.value
    # A 1-token bucket keeps the one-at-a-time arm honest: on the CPU a step costs what its
    # padded token count costs, so padding a lone decode to 8 tokens would slow the baseline.
    tokens = tuple(int(t) for t in _TOKEN_BUCKETS.value) or tuple(sorted({1, 8, 32, 64, 128, budget}))
    seq_buckets = tuple(int(s) for s in _SEQ_BUCKETS.value) or tuple(sorted({1, 8, seqs}))
    return LLM(model=_MODEL.value, dtype=dtype or None, max_num_seqs=seqs, max_num_batched_tokens=budget,
               max_model_len=1024, token_buckets=tokens, seq_buckets=seq_buckets, progress=False, **quant)


def fixed_prompts(tokenizer, num_requests: int, prompt_len: int = 0) -> list[list[int]]:
    """The FIXED_QUESTIONS as chat prompts (token ids), cycled to num_requests."""
    base = []
    for q in FIXED_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if prompt_len > 0:
            ids = (ids * (-(-prompt_len // len(ids))))[:prompt_len]
        base.append(ids)
    return [base[i % len(base)] for i in range(num_requests)]


def run_generate(llm, prompts, output_len: int) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def main_fixed() -> dict:
    counts = [int(n) for n in _NUM_REQUESTS.value]
    dtypes = _DTYPES.value or [None]
    llms = {}
    for dtype in dtypes:
        t0 = time.perf_counter()
        llm = build_llm(dtype, max_num_seqs=max(_MAX_NUM_SEQS.value, max(counts)))
        label = llm.engine.dtype + (dtype[dtype.index(":"):] if dtype and ":" in dtype else "")
        llms[label] = llm
        print(f"{label}: start-up {time.perf_counter() - t0:.1f}s "
              f"(compile {llm.engine.compile_seconds:.1f}s)", flush=True)
    for llm in llms.values():
        run_generate(llm, fixed_prompts(llm.engine.tokenizer, 2, _PROMPT_LEN.value), 4)  # warm-up
    compiles_before = {d: llm.engine.get_stats().num_compilations for d, llm in llms.items()}
    runs = {(d, n): [] for d in llms for n in counts}
    for n in counts:
        for _ in range(_REPEATS.value):
            for d, llm in llms.items():
                r = run_generate(llm, fixed_prompts(llm.engine.tokenizer, n, _PROMPT_LEN.value), _OUTPUT_LEN.value)
                runs[d, n].append(r["output_tokens_per_s"])
        print(f"N={n}: " + ", ".join(f"{d} {statistics.median(runs[d, n]):.1f} tok/s "
                                     f"({', '.join(f'{x:.1f}' for x in runs[d, n])})" for d in llms), flush=True)
    result = {"command": "python -m experiments.bench.offline " + _flags_line(
        "dataset", "model", "num_requests", "prompt_len", "output_len", "repeats", "dtypes", "max_num_seqs",
        "max_num_batched_tokens", "token_buckets", "seq_buckets", "expert_load"),
        "platform": _platform(), "model": next(iter(llms.values())).engine.model_name,
        "median_output_tokens_per_s": {d: {n: statistics.median(runs[d, n]) for n in counts} for d in llms},
        "runs": {f"{d}/{n}": v for (d, n), v in runs.items()},
        "compilations_during_runs": {d: llm.engine.get_stats().num_compilations - compiles_before[d]
                                     for d, llm in llms.items()}}
    print("| dtype | " + " | ".join(f"N={n}" for n in counts) + " |")
    print("| --- |" + " --- |" * len(counts))
    for d in llms:
        print(f"| {d} | " + " | ".join(f"{result['median_output_tokens_per_s'][d][n]:.1f}" for n in counts) + " |")
    print(f"compilations during the runs: {result['compilations_during_runs']}")
    if _PROFILE.value:
        result["profile"] = {}
        for d, llm in llms.items():
            for n in counts:
                print(f"\nprofile: {d}, N={n} x {_OUTPUT_LEN.value} tokens (medians, ms)")
                prompts = fixed_prompts(llm.engine.tokenizer, n, _PROMPT_LEN.value)
                result["profile"][f"{d}/{n}"] = profiled(
                    llm.engine, lambda llm=llm, prompts=prompts: run_generate(llm, prompts, _OUTPUT_LEN.value))
    if _EXPERT_LOAD.value:
        result["expert_load"] = expert_load_runs(counts, dtypes[0])
    return result


def expert_load_runs(counts: list[int], dtype: str | None) -> dict:
    """One recorded run per N on an engine built inside an ExpertLoadRecorder; prints a table."""
    import numpy as np

    from experiments.bench.expert_load import recorded_run, summarize
    from models.moe import ExpertLoadRecorder

    out = {}
    with ExpertLoadRecorder() as recorder:
        llm = build_llm(dtype, max_num_seqs=max(_MAX_NUM_SEQS.value, max(counts)))
        config = llm.engine.model_config
        if not config.num_experts:
            raise ValueError(f"--expert_load: {llm.engine.model_name} is not a mixture of experts")
        rng = np.random.default_rng(0)
        for n in counts:
            # Distinct prompts of the fixed prompts' lengths: copies of the 4 fixed prompts would
            # route identically and multiply every load by their count.
            prompts = [rng.integers(0, config.vocab_size, len(p)).tolist()
                       for p in fixed_prompts(llm.engine.tokenizer, n, _PROMPT_LEN.value)]
            steps = recorded_run(llm, recorder, lambda p=prompts: run_generate(llm, p, _OUTPUT_LEN.value),
                                 config.num_layers)
            out[n] = summarize(steps, config.num_experts_per_tok)
    e, k = config.num_experts, config.num_experts_per_tok
    print(f"\nexpert load imbalance (max / mean assignments per expert; {e} experts, top-{k}: 1 = even, "
          f"{e / k:g} = all on {k}), per step = mean over the {config.num_layers} layers")
    print("| N | steps | tokens/step (median) | median | p90 | max (steps >= median tokens) | max | "
          "worst layer | even floor (median) | run-long |")
    print("| --- |" + " --- |" * 9)
    for n, r in out.items():
        print(f"| {n} | {r['steps']} | {r['tokens_per_step_median']:g} | {r['imbalance_median']:.2f} | "
              f"{r['imbalance_p90']:.2f} | {r['imbalance_max_full_steps']:.2f} | {r['imbalance_max']:.2f} | "
              f"{r['worst_layer_max']:.2f} | {r['even_floor_median']:.2f} | {r['run_imbalance']:.3f} |")
    return out


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


def main_sharegpt() -> dict:
    from engine import SamplingParams
    from experiments.lab.datasets import DatasetOptions, build_samples
    from experiments.lab.step_profiler import StepProfiler

    t0 = time.perf_counter()
    engine = build_llm((_DTYPES.value or [None])[0]).engine
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
    profiler = StepProfiler().attach(engine) if _PROFILE.value else None
    batched = run_arm(engine, samples, params_for)
    pad = engine.runner.num_padded_tokens - padded_before[0]
    real = engine.runner.num_real_tokens - padded_before[1]
    batched["padded_token_share"] = pad / (pad + real)
    engine.reconfigure_scheduler(max_num_seqs=1)
    sequential = run_arm(engine, samples[: _NUM_SEQUENTIAL.value], params_for)
    engine.reconfigure_scheduler(max_num_seqs=_MAX_NUM_SEQS.value)
    result = {
        "command": "python -m experiments.bench.offline " + _flags_line(
            "num_prompts", "num_sequential", "max_prompt_len", "max_output_len", "max_num_seqs",
            "max_num_batched_tokens"),
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
    if profiler is not None:
        print("\nprofile, both arms (medians, ms)")
        print(profiler.table())
        result["profile"] = profiler.rows()
    return result


def profiled(engine, run) -> dict:
    """run() under the step profiler (and the op profile with --op_profile); prints both."""
    from experiments.lab.op_profile import OpProfile
    from experiments.lab.step_profiler import StepProfiler

    profiler = StepProfiler().attach(engine)
    if _OP_PROFILE.value:
        with OpProfile(engine) as ops:
            run()
    else:
        run()
    del engine.step  # detach: back to the class's step
    engine.runner.profile = None
    print(profiler.table())
    out = {"steps": profiler.rows()}
    if _OP_PROFILE.value:
        print("\ndevice time by op class (own time of each XLA op, summed over the run)")
        print(ops.table())
        out["op_classes"] = ops.rows()
    return out


def main_random() -> dict:
    import numpy as np

    from engine import SamplingParams

    engine = build_llm((_DTYPES.value or [None])[0]).engine
    prompt_len = _PROMPT_LEN.value or 128
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, engine.model_config.vocab_size, prompt_len).tolist(), _OUTPUT_LEN.value)
               for _ in range(_NUM_PROMPTS.value)]
    params_for = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    run_arm(engine, samples[:2], params_for)  # warm-up
    compiles_before = engine.get_stats().num_compilations
    timed = run_arm(engine, samples, params_for)
    result = {"command": "python -m experiments.bench.offline " + _flags_line(
        "dataset", "model", "num_prompts", "prompt_len", "output_len", "dtypes", "max_num_seqs",
        "max_num_batched_tokens", "token_buckets", "seq_buckets"),
        "platform": _platform(), "model": engine.model_name, "dtype": engine.dtype, "timed": timed,
        "compilations_during_run": engine.get_stats().num_compilations - compiles_before}
    print(f"random {prompt_len}/{_OUTPUT_LEN.value}, {len(samples)} requests, {_MAX_NUM_SEQS.value} rows: "
          f"{timed['output_tokens_per_s']:.1f} output tok/s over {timed['steps']} steps "
          f"({timed['seconds']:.1f} s; compilations during the run: {result['compilations_during_run']})")
    if _PROFILE.value:
        print("\nprofile (medians, ms)")
        result["profile"] = profiled(engine, lambda: run_arm(engine, samples, params_for))
    return result


def main(argv) -> None:
    del argv
    result = {"fixed": main_fixed, "random": main_random}.get(_DATASET.value, main_sharegpt)()
    path = _RESULT_JSON.value or f"experiments/results/bench_offline_{_DATASET.value}.json".replace("_sharegpt", "")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def _flags_line(*names: str) -> str:
    parts = []
    for name in names:
        value = flags.FLAGS[name].value
        if isinstance(value, list):
            value = ",".join(value)
        parts.append(f"--{name}={value}")
    return " ".join(parts)


def _platform() -> str:
    import jax

    return jax.devices()[0].platform


if __name__ == "__main__":
    app.run(main)
