"""Chunked prefill: a long prompt arrives while N users stream; their inter-token latency, with and
without chunking, and the newcomer's TTFT.

    python -m experiments.ideas.chunked_prefill [--num_users=8 --long_prompt_len=4096]

1. Workload: `--num_users` requests with random `--user_prompt_len`-token prompts, all sent at
   t = 0, each generating `--user_output_len` tokens (greedy, ignore_eos). At `--long_arrival_s`,
   when they are decoding, one request with a `--long_prompt_len`-token prompt arrives.
2. One engine whose largest token bucket holds the whole long prompt plus the users' decodes
   (max_model_len = long prompt + its output, rounded up to a block). The arms swap the scheduler:
   - chunked: `enable_chunked_prefill=True`, token budget `--chunk_budget`: each step runs every
     user's decode plus a slice of the long prompt, so users keep streaming at a slower pace;
   - whole: `enable_chunked_prefill=False`, budget = max_model_len (the scheduler requires it):
     the long prompt runs in one step, and every user waits for it.
3. Reported: the users' max and p99 ITL (pooled over their tokens), their median ITL and TPOT,
   the newcomer's TTFT, and the wall time from its arrival to its first token. Goal: chunking
   cuts the users' max ITL at least 2x.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from absl import app, flags

from experiments.lab import datasets, engine_replay, metrics, report

_MODEL = flags.DEFINE_string("model", "default", "Model to serve.")
_NUM_USERS = flags.DEFINE_integer("num_users", 8, "Requests streaming when the long prompt arrives.")
_USER_PROMPT_LEN = flags.DEFINE_integer("user_prompt_len", 64, "Their prompt tokens.")
_USER_OUTPUT_LEN = flags.DEFINE_integer(
    "user_output_len", 96, "Their output tokens (enough to stream through the long prefill).")
_LONG_PROMPT_LEN = flags.DEFINE_integer("long_prompt_len", 4096, "The newcomer's prompt tokens.")
_LONG_OUTPUT_LEN = flags.DEFINE_integer("long_output_len", 8, "The newcomer's output tokens.")
_LONG_ARRIVAL_S = flags.DEFINE_float("long_arrival_s", 3.0, "When the newcomer arrives (s).")
_CHUNK_BUDGET = flags.DEFINE_integer("chunk_budget", 256, "Token budget with chunked prefill.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt text.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "chunked_prefill", "Result file name (no extension).")

BLOCK_SIZE = 16


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def arm_summary(result: engine_replay.ReplayResult, num_users: int, arrival_s: float) -> dict:
    users, newcomer = result.records[:num_users], result.records[num_users]
    m = metrics.compute_metrics(users, result.duration_s)
    itls = [gap for r in users for gap in r.itls_s]
    arrived = result.start_s + arrival_s
    return {
        "users_itl_ms": report.percentiles_ms(itls),
        "users_tpot_ms_p50": m.tpot_ms.median,
        "users_tokens_before_arrival": sum(t < arrived for r in users for t in r.chunk_times_s),
        "newcomer_ttft_ms": newcomer.ttft_s * 1000.0,
        "newcomer_e2el_ms": newcomer.e2el_s * 1000.0,
        "num_steps": len(result.steps),
        "duration_s": result.duration_s,
        "users_token_times_s": [[round(t - result.start_s, 3) for t in r.chunk_times_s] for r in users],
        "newcomer_first_token_s": newcomer.chunk_times_s[0] - result.start_s,
    }


def plot(arms: dict, arrival_s: float, title: str):
    fig, axes = report.new_figure(3, width=5.0)
    colors = {"chunked": "tab:blue", "whole": "tab:orange"}
    for ax, name in zip(axes[:2], ("whole", "chunked")):
        a = arms[name]
        for u, times in enumerate(a["users_token_times_s"]):
            ax.plot(times, [u] * len(times), "|", color=colors[name], markersize=8)
        ax.axvspan(arrival_s, a["newcomer_first_token_s"], color="gray", alpha=0.2,
                   label="long prompt: arrival to first token")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("user")
        ax.set_title(f"{name} prefill: users' tokens (max ITL {a['users_itl_ms']['max'] / 1e3:.1f} s)")
        ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    labels = ("users max ITL", "users p99 ITL", "newcomer TTFT")
    width = 0.38
    for k, name in enumerate(("whole", "chunked")):
        a = arms[name]
        values = [a["users_itl_ms"]["max"], a["users_itl_ms"]["p99"], a["newcomer_ttft_ms"]]
        ax.bar([i + (k - 0.5) * width for i in range(3)], [v / 1000 for v in values], width,
               label=name, color=colors[name])
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("seconds")
    ax.legend()
    fig.suptitle(title)
    return fig


def main(argv: Sequence[str]) -> None:
    del argv
    t_start = time.perf_counter()
    num_users = _NUM_USERS.value
    max_model_len = _round_up(_LONG_PROMPT_LEN.value + _LONG_OUTPUT_LEN.value + 1, BLOCK_SIZE)
    user_blocks = -(-(_USER_PROMPT_LEN.value + _USER_OUTPUT_LEN.value + 8) // BLOCK_SIZE)
    users_prefill = _round_up(num_users * (_USER_PROMPT_LEN.value + 8), BLOCK_SIZE)
    buckets = sorted({16, _CHUNK_BUDGET.value, min(users_prefill, max_model_len), max_model_len})
    engine = engine_replay.build_engine(
        model=_MODEL.value, max_num_seqs=num_users + 1, max_num_batched_tokens=max_model_len,
        max_model_len=max_model_len, block_size=BLOCK_SIZE, enable_prefix_caching=False,
        num_kv_blocks=max_model_len // BLOCK_SIZE + num_users * user_blocks + 2,
        token_buckets=tuple(buckets), seq_buckets=(num_users + 1,))
    users = datasets.load_random(engine.tokenizer, num_users, _USER_PROMPT_LEN.value,
                                 _USER_OUTPUT_LEN.value, seed=_SEED.value)
    (long,) = datasets.load_random(engine.tokenizer, 1, _LONG_PROMPT_LEN.value,
                                   _LONG_OUTPUT_LEN.value, seed=_SEED.value + 1)
    samples = [dataclasses.replace(s, arrival_offset_s=0.0) for s in users]
    samples.append(dataclasses.replace(long, arrival_offset_s=_LONG_ARRIVAL_S.value))
    config = engine_replay.ReplayConfig(use_arrival_offsets=True)
    arms = {}
    arm_knobs = {
        "whole": dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len),
        "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=_CHUNK_BUDGET.value),
    }
    for name, knobs in arm_knobs.items():
        engine_replay.swap_scheduler(engine, **knobs)
        t0 = time.perf_counter()
        result = engine_replay.replay(engine, samples, config)
        arms[name] = arm_summary(result, num_users, _LONG_ARRIVAL_S.value)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)

    whole, chunked = arms["whole"], arms["chunked"]
    cut = report.ratio(whole["users_itl_ms"]["max"], chunked["users_itl_ms"]["max"])
    goals = [report.goal("users' max ITL, whole / chunked", cut, 2.0)]
    headers = ["arm", "budget", "users max ITL (ms)", "users p99 ITL (ms)", "users p50 ITL (ms)",
               "users TPOT p50 (ms)", "newcomer TTFT (ms)", "steps"]
    rows = [[n, arm_knobs[n]["max_num_batched_tokens"], a["users_itl_ms"]["max"],
             a["users_itl_ms"]["p99"], a["users_itl_ms"]["p50"], a["users_tpot_ms_p50"],
             a["newcomer_ttft_ms"], a["num_steps"]] for n, a in arms.items()]
    text = (f"{num_users} users ({users[0].prompt_len}-token prompts, {_USER_OUTPUT_LEN.value} output "
            f"tokens) stream; a {long.prompt_len}-token prompt arrives at t = {_LONG_ARRIVAL_S.value:g} s. "
            f"{engine.model_name} on {report.environment()['platform']}, buckets {list(buckets)}.\n\n"
            + report.markdown_table(headers, rows) + "\n"
            + f"- users' p99 ITL whole / chunked: "
              f"{report.ratio(whole['users_itl_ms']['p99'], chunked['users_itl_ms']['p99']):.2f}; "
              f"newcomer TTFT chunked / whole: "
              f"{report.ratio(chunked['newcomer_ttft_ms'], whole['newcomer_ttft_ms']):.2f}\n"
            + report.goals_text(goals))
    print(text)
    summary = {
        "experiment": "chunked_prefill", "command": report.command_line(),
        "environment": report.environment(), "model": engine.model_name,
        "config": {"num_users": num_users, "user_prompt_len": _USER_PROMPT_LEN.value,
                   "user_output_len": _USER_OUTPUT_LEN.value, "long_prompt_len": long.prompt_len,
                   "long_output_len": _LONG_OUTPUT_LEN.value, "long_arrival_s": _LONG_ARRIVAL_S.value,
                   "chunk_budget": _CHUNK_BUDGET.value, "max_model_len": max_model_len,
                   "token_buckets": list(buckets), "seed": _SEED.value},
        "arms": arms, "max_itl_cut": cut, "goals": goals, "elapsed_s": time.perf_counter() - t_start,
    }
    fig = plot(arms, _LONG_ARRIVAL_S.value,
               f"chunked prefill: a {long.prompt_len}-token prompt among {num_users} streams "
               f"(max ITL cut {cut:.1f}x)")
    paths = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
