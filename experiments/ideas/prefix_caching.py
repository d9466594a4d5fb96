"""Prefix caching on shared system prompts: TTFT and prefill tokens computed, with and without.

    python -m experiments.ideas.prefix_caching [--num_prefixes=4 --questions_per_prefix=8]

1. Workload (`experiments.lab.datasets` shared-prefix): `--num_prefixes` system prompts of
   `--prefix_len` tokens, each followed by `--questions_per_prefix` questions of `--question_len`
   tokens, shuffled so prefixes interleave; `--output_len` tokens each (greedy, ignore_eos),
   sent as a Poisson process of `--request_rate` per second, a load the engine sustains without
   the cache, so TTFT measures the prefill work rather than a queue (inf: all at t = 0).
2. One engine; the arms swap the scheduler with `enable_prefix_caching` on and off (each arm
   starts with an empty cache, so every system prompt is computed once in the cached arm).
3. Reported per arm: TTFT (mean, median, p95), E2EL, throughput, and the prefill work: prompt
   tokens, prefix-cache hit tokens, and prompt tokens computed (= tokens fed to the model minus
   the decode tokens; a cache hit is not fed). Goal: prefix caching cuts the median TTFT >= 2x.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from absl import app, flags

from experiments.lab import datasets, engine_replay, metrics, report

_MODEL = flags.DEFINE_string("model", "default", "Model to serve.")
_NUM_PREFIXES = flags.DEFINE_integer("num_prefixes", 4, "System prompts.")
_QUESTIONS_PER_PREFIX = flags.DEFINE_integer("questions_per_prefix", 8, "Questions per prompt.")
_PREFIX_LEN = flags.DEFINE_integer("prefix_len", 400, "System prompt tokens.")
_QUESTION_LEN = flags.DEFINE_integer("question_len", 32, "Question tokens.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 16, "Output tokens per request.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Rows per step.")
_MAX_NUM_BATCHED_TOKENS = flags.DEFINE_integer("max_num_batched_tokens", 256, "Token budget.")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["16", "64", "256"], "Padded token counts.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "Longest sequence.")
_REQUEST_RATE = flags.DEFINE_float(
    "request_rate", 0.3, "Poisson requests / s (below the uncached capacity); inf = all at once.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt text, order and arrivals.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "prefix_caching", "Result file name (no extension).")

ARMS = (("no cache", False), ("prefix cache", True))


def run_arm(engine, samples, config: engine_replay.ReplayConfig, enable: bool) -> dict:
    engine_replay.swap_scheduler(engine, enable_prefix_caching=enable)
    fed_before = engine.runner.num_real_tokens
    result = engine_replay.replay(engine, samples, config)
    stats = engine.scheduler.stats
    m = metrics.compute_metrics(result.records, result.duration_s)
    prompt_tokens = sum(r.prompt_len for r in result.records)
    decode_fed = sum(max(r.output_tokens - 1, 0) for r in result.records)
    return {
        "metrics": report.metrics_summary(m),
        "ttft_ms": report.percentiles_ms([r.ttft_s for r in result.records]),
        "prompt_tokens": prompt_tokens,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "prompt_tokens_computed": engine.runner.num_real_tokens - fed_before - decode_fed,
        "num_preemptions": stats.num_preemptions,
        "num_steps": len(result.steps),
        "ttft_s_per_request": [round(r.ttft_s, 3) for r in result.records],
    }


def plot(arms: dict, title: str):
    fig, (ax_cdf, ax_tok) = report.new_figure(2, width=5.5)
    colors = {"no cache": "tab:orange", "prefix cache": "tab:blue"}
    for name, a in arms.items():
        ttfts = sorted(a["ttft_s_per_request"])
        ax_cdf.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                    label=f"{name} (median {a['ttft_ms']['p50'] / 1e3:.1f} s)", color=colors[name])
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT distribution")
    ax_cdf.legend()
    names = list(arms)
    ax_tok.bar(names, [arms[n]["prompt_tokens_computed"] for n in names],
               color=[colors[n] for n in names], label="prompt tokens computed")
    ax_tok.bar(names, [arms[n]["prefix_cache_hit_tokens"] for n in names],
               bottom=[arms[n]["prompt_tokens_computed"] for n in names], color="lightgray",
               label="prefix-cache hits")
    ax_tok.set_ylabel("prompt tokens")
    ax_tok.set_title("prefill work")
    ax_tok.legend()
    fig.suptitle(title)
    return fig


def main(argv: Sequence[str]) -> None:
    del argv
    t_start = time.perf_counter()
    engine = engine_replay.build_engine(
        model=_MODEL.value, max_num_seqs=_MAX_NUM_SEQS.value,
        max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS.value, max_model_len=_MAX_MODEL_LEN.value,
        num_kv_blocks=_MAX_NUM_SEQS.value * -(-_MAX_MODEL_LEN.value // 16) + 1,
        token_buckets=tuple(int(t) for t in _TOKEN_BUCKETS.value), seq_buckets=(_MAX_NUM_SEQS.value,))
    samples = datasets.load_shared_prefix(
        engine.tokenizer, _NUM_PREFIXES.value, _QUESTIONS_PER_PREFIX.value, _PREFIX_LEN.value,
        _QUESTION_LEN.value, _OUTPUT_LEN.value, seed=_SEED.value)
    config = engine_replay.ReplayConfig(request_rate=_REQUEST_RATE.value, seed=_SEED.value)
    arms = {}
    for name, enable in ARMS:
        t0 = time.perf_counter()
        arms[name] = run_arm(engine, samples, config, enable)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)

    off, on = arms["no cache"], arms["prefix cache"]
    cut = report.ratio(off["ttft_ms"]["p50"], on["ttft_ms"]["p50"])
    goals = [report.goal("median TTFT, no cache / prefix cache", cut, 2.0)]
    headers = ["arm", "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p95 (ms)", "E2EL p50 (ms)",
               "req/s", "prompt tokens", "cache hits", "prompt tokens computed", "steps"]
    rows = [[n, a["ttft_ms"]["mean"], a["ttft_ms"]["p50"], a["ttft_ms"]["p95"],
             a["metrics"]["e2el_ms_p50"], a["metrics"]["request_throughput"], a["prompt_tokens"],
             a["prefix_cache_hit_tokens"], a["prompt_tokens_computed"], a["num_steps"]]
            for n, a in arms.items()]
    text = (f"{len(samples)} requests: {_NUM_PREFIXES.value} system prompts of {_PREFIX_LEN.value} "
            f"tokens x {_QUESTIONS_PER_PREFIX.value} questions of {_QUESTION_LEN.value} tokens, "
            f"{_OUTPUT_LEN.value} output tokens each, request rate {_REQUEST_RATE.value:g}/s; "
            f"{engine.model_name} on {report.environment()['platform']}, budget "
            f"{_MAX_NUM_BATCHED_TOKENS.value} tokens/step, max_num_seqs {_MAX_NUM_SEQS.value}.\n\n"
            + report.markdown_table(headers, rows) + "\n"
            + f"- mean TTFT cut {report.ratio(off['ttft_ms']['mean'], on['ttft_ms']['mean']):.2f}x; "
              f"prompt tokens computed cut "
              f"{report.ratio(off['prompt_tokens_computed'], on['prompt_tokens_computed']):.2f}x\n"
            + report.goals_text(goals))
    print(text)
    summary = {
        "experiment": "prefix_caching", "command": report.command_line(),
        "environment": report.environment(), "model": engine.model_name,
        "config": {"num_prefixes": _NUM_PREFIXES.value,
                   "questions_per_prefix": _QUESTIONS_PER_PREFIX.value,
                   "prefix_len": _PREFIX_LEN.value, "question_len": _QUESTION_LEN.value,
                   "output_len": _OUTPUT_LEN.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                   "max_num_batched_tokens": _MAX_NUM_BATCHED_TOKENS.value,
                   "max_model_len": _MAX_MODEL_LEN.value, "token_buckets": engine.runner.shapes.token_buckets,
                   "request_rate": _REQUEST_RATE.value, "seed": _SEED.value},
        "arms": arms, "ttft_cut": cut, "goals": goals, "elapsed_s": time.perf_counter() - t_start,
    }
    fig = plot(arms, f"prefix caching on shared system prompts (median TTFT cut {cut:.1f}x)")
    paths = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
