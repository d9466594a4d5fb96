"""Static against continuous batching on the same ShareGPT mix, on one engine.

    python -m experiments.ideas.static_vs_continuous [--num_prompts=48 --out_dir=experiments/results]

1. Workload: ShareGPT (first human turn, the gpt answer's token length as the output length,
   vLLM's filter: prompt <= `--max_prompt_len`, prompt + answer <= 2048). Both lengths are then
   *scaled* by `--length_scale` (the prompt's token ids are cut and decoded; the output length is
   multiplied, then clipped to `--max_output_len`) so the mix keeps its shape at a CPU's size:
   the spread of output lengths is what separates the two policies, and clipping ShareGPT's
   answers (median ~270 tokens) to a small cap would make most of them equal. All requests
   arrive at t = 0 (or at `--request_rate`); greedy, ignore_eos, so both arms generate the same
   tokens.
2. One engine (compiled once, warmed up); the arms swap only the scheduler: `policy="static"`
   (a batch of up to max_num_seqs is admitted only when the previous one has completely finished)
   against `policy="fcfs"` (continuous batching: a finished request's row is refilled next step).
   Buckets are fine-grained (4 .. 256 tokens, 4 / 8 / 16 rows), as the engine's defaults are, so a
   static batch that has drained to a few rows runs in a cheaper bucket on the CPU.
3. Reported per arm, with `experiments.lab.metrics`: request and output-token throughput, and the
   p50/p95 TTFT and end-to-end latency of the short requests (expected output <= the median) and
   of all requests. Goal: continuous >= 2x static's output throughput.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from absl import app, flags

from experiments.lab import datasets, engine_replay, metrics, report

_MODEL = flags.DEFINE_string("model", "default", "Model to serve.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 128, "ShareGPT requests.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 1024, "Drop longer ShareGPT prompts.")
_LENGTH_SCALE = flags.DEFINE_float("length_scale", 0.125, "Prompt and output lengths times this.")
_MAX_OUTPUT_LEN = flags.DEFINE_integer("max_output_len", 128, "Scaled outputs are clipped to this.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "Longest sequence.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Rows per step (the static batch size).")
_MAX_NUM_BATCHED_TOKENS = flags.DEFINE_integer("max_num_batched_tokens", 256, "Token budget.")
_TOKEN_BUCKETS = flags.DEFINE_list(
    "token_buckets", ["4", "8", "16", "32", "64", "128", "256"], "Padded token counts.")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", ["4", "8", "16"], "Padded request counts.")
_REQUEST_RATE = flags.DEFINE_float("request_rate", float("inf"), "Requests / s; inf = all at once.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling of ShareGPT records and arrivals.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "static_vs_continuous", "Result file name (no extension).")

ARMS = (("continuous", "fcfs"), ("static", "static"))


def scale_sample(tokenizer, sample: datasets.SampleRequest, scale: float,
                 max_output_len: int) -> datasets.SampleRequest:
    """The sample with its prompt cut to `scale` of its tokens and its output length scaled."""
    ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
    prompt = tokenizer.decode(ids[: max(1, round(len(ids) * scale))])
    output_len = min(max_output_len, max(1, round(sample.expected_output_len * scale)))
    return dataclasses.replace(sample, prompt=prompt, expected_output_len=output_len,
                               prompt_len=len(tokenizer.encode(prompt, add_special_tokens=False)))


def build_workload(tokenizer, num_prompts: int, max_prompt_len: int, length_scale: float,
                   max_output_len: int, seed: int) -> list[datasets.SampleRequest]:
    samples = datasets.load_sharegpt(tokenizer, num_prompts, seed=seed, max_prompt_len=max_prompt_len)
    return [scale_sample(tokenizer, s, length_scale, max_output_len) for s in samples]


def arm_summary(result: engine_replay.ReplayResult, output_lens: Sequence[int]) -> dict:
    m = metrics.compute_metrics(result.records, result.duration_s)
    short = report.short_records(result.records, output_lens)
    return {
        "all": report.metrics_summary(m),
        "short": {
            "num_requests": len(short),
            "ttft_ms": report.percentiles_ms([r.ttft_s for r in short]),
            "e2el_ms": report.percentiles_ms([r.e2el_s for r in short]),
        },
        "num_steps": len(result.steps),
        "timeline": [(round(s.end_s - result.start_s, 3), s.num_running) for s in result.steps],
    }


def plot(arms: dict, path_figure_title: str):
    fig, (ax_tp, ax_lat, ax_run) = report.new_figure(3, width=5.0)
    names = list(arms)
    colors = {"continuous": "tab:blue", "static": "tab:orange"}
    ax_tp.bar(names, [arms[n]["all"]["output_throughput"] for n in names],
              color=[colors.get(n, "gray") for n in names])
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput")
    width = 0.2
    labels = ("TTFT p50", "TTFT p95", "E2EL p50", "E2EL p95")
    for k, name in enumerate(names):
        s = arms[name]["short"]
        values = [s["ttft_ms"]["p50"], s["ttft_ms"]["p95"], s["e2el_ms"]["p50"], s["e2el_ms"]["p95"]]
        ax_lat.bar([i + (k - 0.5) * width for i in range(4)], [v / 1000 for v in values], width,
                   label=name, color=colors.get(name, "gray"))
    ax_lat.set_xticks(range(4), labels)
    ax_lat.set_ylabel("seconds")
    ax_lat.set_title("latency of the short requests")
    ax_lat.legend()
    for name in names:
        t, running = zip(*arms[name]["timeline"])
        ax_run.step(t, running, where="post", label=name, color=colors.get(name, "gray"))
    ax_run.set_xlabel("time (s)")
    ax_run.set_ylabel("running requests")
    ax_run.set_title("batch occupancy")
    ax_run.legend()
    fig.suptitle(path_figure_title)
    return fig


def main(argv: Sequence[str]) -> None:
    del argv
    t_start = time.perf_counter()
    engine = engine_replay.build_engine(
        model=_MODEL.value, max_num_seqs=_MAX_NUM_SEQS.value,
        max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS.value,
        max_model_len=_MAX_MODEL_LEN.value,
        num_kv_blocks=_MAX_NUM_SEQS.value * -(-_MAX_MODEL_LEN.value // 16) + 1,
        token_buckets=tuple(int(t) for t in _TOKEN_BUCKETS.value), seq_buckets=tuple(int(s) for s in _SEQ_BUCKETS.value))
    samples = build_workload(engine.tokenizer, _NUM_PROMPTS.value, _MAX_PROMPT_LEN.value,
                             _LENGTH_SCALE.value, _MAX_OUTPUT_LEN.value, _SEED.value)
    output_lens = [s.expected_output_len for s in samples]
    config = engine_replay.ReplayConfig(request_rate=_REQUEST_RATE.value, seed=_SEED.value)
    arms = {}
    for name, policy in ARMS:
        engine_replay.swap_scheduler(engine, policy=policy)
        t0 = time.perf_counter()
        arms[name] = arm_summary(engine_replay.replay(engine, samples, config), output_lens)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)

    c, s = arms["continuous"], arms["static"]
    speedup = report.ratio(c["all"]["output_throughput"], s["all"]["output_throughput"])
    step_ratio = report.ratio(s["num_steps"], c["num_steps"])
    goals = [report.goal("continuous / static output throughput", speedup, 2.0)]
    headers = ["arm", "req/s", "out tok/s", "steps", "short TTFT p50 / p95 (s)",
               "short E2EL p50 / p95 (s)", "all E2EL p50 / p95 (s)"]
    rows = [[name, a["all"]["request_throughput"], a["all"]["output_throughput"], a["num_steps"],
             f"{a['short']['ttft_ms']['p50'] / 1e3:.1f} / {a['short']['ttft_ms']['p95'] / 1e3:.1f}",
             f"{a['short']['e2el_ms']['p50'] / 1e3:.1f} / {a['short']['e2el_ms']['p95'] / 1e3:.1f}",
             f"{a['all']['e2el_ms_p50'] / 1e3:.1f} / {a['all']['e2el_ms_p95'] / 1e3:.1f}"]
            for name, a in arms.items()]
    prompt_lens = [s.prompt_len for s in samples]
    text = (f"{len(samples)} ShareGPT requests, prompt and output lengths x {_LENGTH_SCALE.value:g} "
            f"(outputs <= {_MAX_OUTPUT_LEN.value}; mean prompt {sum(prompt_lens) / len(samples):.0f}, "
            f"mean output {sum(output_lens) / len(samples):.0f}, median output "
            f"{sorted(output_lens)[len(output_lens) // 2]} tokens), max_num_seqs={_MAX_NUM_SEQS.value}, "
            f"{engine.model_name} on {report.environment()['platform']}. Short = output <= median "
            f"({c['short']['num_requests']} requests).\n\n" + report.markdown_table(headers, rows)
            + f"\n- steps to finish, static / continuous: {step_ratio:.2f} (the ratio where a step costs the "
              "same whatever its batch, as decode roughly does on an accelerator; on this CPU a "
              "drained static batch runs in a smaller, cheaper bucket)\n" + report.goals_text(goals))
    print(text)
    summary = {
        "experiment": "static_vs_continuous", "command": report.command_line(),
        "environment": report.environment(), "model": engine.model_name,
        "config": {"num_prompts": len(samples), "max_prompt_len": _MAX_PROMPT_LEN.value,
                   "length_scale": _LENGTH_SCALE.value, "max_output_len": _MAX_OUTPUT_LEN.value,
                   "max_model_len": _MAX_MODEL_LEN.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                   "max_num_batched_tokens": _MAX_NUM_BATCHED_TOKENS.value,
                   "token_buckets": engine.runner.shapes.token_buckets,
                   "request_rate": str(_REQUEST_RATE.value), "seed": _SEED.value},
        "workload": {"prompt_lens": prompt_lens, "output_lens": output_lens},
        "arms": arms, "speedup": speedup, "step_ratio": step_ratio, "goals": goals,
        "elapsed_s": time.perf_counter() - t_start,
    }
    fig = plot(arms, f"static vs continuous batching ({engine.model_name}, speedup {speedup:.2f}x)")
    paths = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
