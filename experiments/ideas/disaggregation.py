"""Prefill/decode disaggregation: streaming users while long prompts keep arriving.

    python -m experiments.ideas.disaggregation [--num_users=4 --num_long=6 --long_rate=0.3]

Workload: `--num_users` requests (random `--user_prompt_len`-token prompts, `--user_output_len`
tokens each, greedy, ignore_eos) start at t = 0; `--num_long` prompts of `--long_prompt_min` ..
`--long_prompt_max` tokens arrive as a Poisson stream of `--long_rate` per second from
`--long_start_s` on. Three arms with the same two CPU cores:
- colocated, whole prefill: one LLMEngine (both cores), each long prompt in one step;
- colocated, chunked prefill (`--chunk_budget` tokens per step);
- disaggregated: a PDEngine whose prefill pool is this process pinned to core 0 and whose decode
  pool is another process (`python -m engine.disaggregation.decode_pool`) pinned to core 1, so the
  two pools do not share compute (with `--nopin`: both unpinned, for machines with one core). Its
  users are also run alone (no long prompts) for the baseline of the goal.
Reported per arm: the users' ITL p50 / p95 / max and TPOT, the newcomers' TTFT, the output
throughput, and for the disaggregated arm the transfers. Goal (the issue's): the users' p95 ITL
under the prompt stream within 1.3x of theirs with no prompts arriving, disaggregated.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import dataclasses  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments.lab import datasets, engine_replay, metrics, report  # noqa: E402

_MODEL = flags.DEFINE_string("model", "default", "Model to serve.")
_NUM_USERS = flags.DEFINE_integer("num_users", 4, "Streaming users (start at t = 0).")
_USER_PROMPT_LEN = flags.DEFINE_integer("user_prompt_len", 64, "Their prompt tokens.")
_USER_OUTPUT_LEN = flags.DEFINE_integer("user_output_len", 96, "Their output tokens.")
_NUM_LONG = flags.DEFINE_integer("num_long", 6, "Long prompts arriving.")
_LONG_MIN = flags.DEFINE_integer("long_prompt_min", 512, "Shortest long prompt (tokens).")
_LONG_MAX = flags.DEFINE_integer("long_prompt_max", 1024, "Longest long prompt (tokens).")
_LONG_OUTPUT_LEN = flags.DEFINE_integer("long_output_len", 8, "Their output tokens.")
_LONG_RATE = flags.DEFINE_float("long_rate", 0.3, "Long prompts per second (Poisson).")
_LONG_START_S = flags.DEFINE_float("long_start_s", 1.0, "When the stream of long prompts starts.")
_CHUNK_BUDGET = flags.DEFINE_integer("chunk_budget", 128, "Token budget with chunked prefill.")
_PIN = flags.DEFINE_bool("pin", True, "Pin the disaggregated pools to separate cores (0 and 1).")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt text and arrivals.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "disaggregation", "Result file name (no extension).")

BLOCK_SIZE = 16


def _workload(tokenizer):
    rng = np.random.default_rng(_SEED.value)
    users = datasets.load_random(tokenizer, _NUM_USERS.value, _USER_PROMPT_LEN.value, _USER_OUTPUT_LEN.value,
                                 seed=_SEED.value)
    users = [dataclasses.replace(s, arrival_offset_s=0.0) for s in users]
    longs, t = [], _LONG_START_S.value
    for i in range(_NUM_LONG.value):
        n = int(rng.integers(_LONG_MIN.value, _LONG_MAX.value + 1))
        (s,) = datasets.load_random(tokenizer, 1, n, _LONG_OUTPUT_LEN.value, seed=_SEED.value + 1 + i)
        longs.append(dataclasses.replace(s, arrival_offset_s=t))
        t += float(rng.exponential(1.0 / _LONG_RATE.value))
    return users, longs


def _summary(result, num_users: int) -> dict:
    users, longs = result.records[:num_users], result.records[num_users:]
    m = metrics.compute_metrics(result.records, result.duration_s)
    itls = [gap for r in users for gap in r.itls_s]
    return {"users_itl_ms": report.percentiles_ms(itls),
            "users_tpot_ms_p50": metrics.compute_metrics(users, result.duration_s).tpot_ms.median,
            "newcomers_ttft_ms": report.percentiles_ms([r.ttft_s for r in longs]) if longs else None,
            "output_tok_per_s": m.output_throughput, "duration_s": result.duration_s}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: Sequence[str]) -> None:
    del argv
    from engine.config import EngineConfig
    from engine.disaggregation.pd_engine import PDEngine

    t_start = time.perf_counter()
    all_cores = os.sched_getaffinity(0)
    pin = _PIN.value and len(all_cores) >= 2
    core0, core1 = sorted(all_cores)[:2] if pin else (None, None)
    max_model_len = -(-(_LONG_MAX.value + _LONG_OUTPUT_LEN.value + 1) // BLOCK_SIZE) * BLOCK_SIZE
    user_blocks = -(-(_USER_PROMPT_LEN.value + _USER_OUTPUT_LEN.value + 8) // BLOCK_SIZE)
    num_blocks = 2 * (max_model_len // BLOCK_SIZE) + _NUM_USERS.value * user_blocks + 2
    budget = _CHUNK_BUDGET.value
    knobs = dict(model=_MODEL.value, max_num_seqs=_NUM_USERS.value + 2, max_model_len=max_model_len,
                 block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, enable_prefix_caching=True,
                 seq_buckets=(_NUM_USERS.value + 2,), compilation_cache_dir=None)
    colocated = engine_replay.build_engine(**knobs, max_num_batched_tokens=max_model_len,
                                           token_buckets=(16, budget, max_model_len))
    users, longs = _workload(colocated.tokenizer)
    config = engine_replay.ReplayConfig(use_arrival_offsets=True)
    arms = {}
    for name, knob in (("colocated, whole", dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len)),
                       ("colocated, chunked", dict(enable_chunked_prefill=True, max_num_batched_tokens=budget))):
        engine_replay.swap_scheduler(colocated, **knob)
        arms[name] = _summary(engine_replay.replay(colocated, users + longs, config), len(users))
        print(f"{name}: done", flush=True)
    del colocated

    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "engine.disaggregation.decode_pool", f"--listen={address}"]
    if pin:
        cmd = ["taskset", "-c", str(core1)] + cmd
        _pin_process({core0})
    proc = subprocess.Popen(cmd, env=env)
    try:
        pd = PDEngine(EngineConfig(**knobs, max_num_batched_tokens=budget, token_buckets=(16, budget),
                                   disaggregation=f"prefill:1,decode:1,decode_address:{address}"), progress=False)
        engine_replay.warm_up(pd.prefill)
        engine_replay.replay(pd, users[:1], config)  # warms the decode process's buckets
        before = pd.get_stats()
        arms["disaggregated"] = _summary(engine_replay.replay(pd, users + longs, config), len(users))
        arms["disaggregated, users alone"] = _summary(engine_replay.replay(pd, users, config), len(users))
        after = pd.get_stats()
        t = after.kv_transfer
        arms["disaggregated"]["transfers"] = {
            "count": t.num_transfers - before.kv_transfer.num_transfers, "bytes": t.num_bytes - before.kv_transfer.num_bytes,
            "ms_per_pull": 1000 * t.seconds / max(t.num_landed, 1), "gb_per_s": t.gb_per_s,
            "fallbacks": t.num_fallbacks}
        compiled = after.num_compilations - before.num_compilations
        pd.decode.close()
    finally:
        _pin_process(all_cores)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    alone = arms["disaggregated, users alone"]["users_itl_ms"]["p95"]
    under = arms["disaggregated"]["users_itl_ms"]["p95"]
    goals = [report.goal("disaggregated users' p95 ITL, prompt stream / alone", report.ratio(under, alone), 1.3,
                         higher_is_better=False)]
    headers = ["arm", "users p50 ITL (ms)", "users p95 ITL (ms)", "users max ITL (ms)", "users TPOT p50 (ms)",
               "newcomers TTFT p50 (ms)", "output tok/s"]
    rows = [[n, a["users_itl_ms"]["p50"], a["users_itl_ms"]["p95"], a["users_itl_ms"]["max"], a["users_tpot_ms_p50"],
             a["newcomers_ttft_ms"]["p50"] if a["newcomers_ttft_ms"] else "-", a["output_tok_per_s"]]
            for n, a in arms.items()]
    tr = arms["disaggregated"]["transfers"]
    text = (f"{len(users)} users ({_USER_PROMPT_LEN.value}-token prompts, {_USER_OUTPUT_LEN.value} output tokens) "
            f"stream from t = 0; {len(longs)} prompts of {_LONG_MIN.value}-{_LONG_MAX.value} tokens arrive "
            f"(Poisson, {_LONG_RATE.value:g}/s from t = {_LONG_START_S.value:g} s). {_MODEL.value} on the CPU; "
            f"chunk budget {budget}; disaggregated pools {'pinned to cores ' + str((core0, core1)) if pin else 'not pinned'} "
            f"(two processes, KV through jax.experimental.transfer).\n\n"
            + report.markdown_table(headers, rows) + "\n"
            + f"- transfers: {tr['count']} requests, {tr['bytes'] / 1e6:.1f} MB gathered, {tr['ms_per_pull']:.1f} ms "
              f"per pull (landed), {tr['gb_per_s']:.2f} GB/s; compilations after warm-up: {compiled}\n"
            + report.goals_text(goals))
    print(text)
    summary = {"experiment": "disaggregation", "command": report.command_line(), "environment": report.environment(),
               "config": {**knobs, "chunk_budget": budget, "pinned": pin, "num_long": len(longs),
                          "long_prompt_lens": [s.prompt_len for s in longs],
                          "long_arrivals_s": [s.arrival_offset_s for s in longs]},
               "arms": arms, "goals": goals, "compilations_after_warm_up": compiled,
               "elapsed_s": time.perf_counter() - t_start}
    fig, (ax,) = report.new_figure(1, width=8.0)
    labels = ("users p50 ITL", "users p95 ITL", "users max ITL")
    width = 0.8 / len(arms)
    for k, (name, a) in enumerate(arms.items()):
        values = [a["users_itl_ms"][q] for q in ("p50", "p95", "max")]
        ax.bar([i + (k - len(arms) / 2 + 0.5) * width for i in range(3)], values, width, label=name)
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    fig.suptitle(f"disaggregation: {len(users)} streams while {len(longs)} long prompts arrive")
    paths = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def _pin_process(cores) -> None:
    """Every thread of this process (XLA's pool included) onto `cores`; new threads inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # a thread that just ended


if __name__ == "__main__":
    app.run(main)
