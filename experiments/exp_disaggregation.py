"""Prefill/decode disaggregation: what it buys and costs when a long prompt arrives among streams.

    python -m experiments.exp_disaggregation [--num_users=4 --long_prompt_len=1024 --user_output_len=64]

The workload and flags are experiments.exp_chunked_prefill's (N users stream; a long prompt
arrives at --long_arrival_s). Two arms on the same model, buckets and chunk budget:
- colocated: one LLMEngine on one device, chunked prefill (the best colocated arm there);
- disaggregated: a PDEngine, prefill:1,decode:1 (two devices; on the CPU two virtual devices of
  one host, which share its cores), the long prompt prefilled in its own pool, its KV moved.
Reported per arm: the users' ITL (p50 / p99 / max) and TPOT, the newcomer's TTFT; for the
disaggregated arm the transfers (count, bytes, ms per request, GB/s, fallbacks).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import dataclasses  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from absl import app, flags  # noqa: E402

from experiments import datasets, engine_replay, exp_chunked_prefill, report  # noqa: E402

base = exp_chunked_prefill  # its flags are this experiment's
_NAME = flags.DEFINE_string("disagg_name", "disaggregation", "Result file name (no extension).")


def _engines(knobs: dict):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.pd_engine import PDEngine

    colocated = LLMEngine(EngineConfig(**knobs), progress=False)
    engine_replay.warm_up(colocated)
    pd = PDEngine(EngineConfig(**knobs, disaggregation="prefill:1,decode:1"), progress=False)
    engine_replay.warm_up(pd.prefill)
    engine_replay.warm_up(pd.decode.engine)
    return {"colocated": colocated, "disaggregated": pd}


def main(argv: Sequence[str]) -> None:
    del argv
    t_start = time.perf_counter()
    num_users, budget = base._NUM_USERS.value, base._CHUNK_BUDGET.value
    bs = base.BLOCK_SIZE
    max_model_len = base._round_up(base._LONG_PROMPT_LEN.value + base._LONG_OUTPUT_LEN.value + 1, bs)
    user_blocks = -(-(base._USER_PROMPT_LEN.value + base._USER_OUTPUT_LEN.value + 8) // bs)
    buckets = sorted({16, budget})
    knobs = dict(model=base._MODEL.value, max_num_seqs=num_users + 1, max_num_batched_tokens=budget,
                 max_model_len=max_model_len, block_size=bs, enable_chunked_prefill=True,
                 num_kv_blocks=max_model_len // bs + num_users * user_blocks + 2,
                 token_buckets=tuple(buckets), seq_buckets=(num_users + 1,), compilation_cache_dir=None)
    engines = _engines(knobs)
    tokenizer = engines["colocated"].tokenizer
    users = datasets.load_random(tokenizer, num_users, base._USER_PROMPT_LEN.value, base._USER_OUTPUT_LEN.value,
                                 seed=base._SEED.value)
    (long,) = datasets.load_random(tokenizer, 1, base._LONG_PROMPT_LEN.value, base._LONG_OUTPUT_LEN.value,
                                   seed=base._SEED.value + 1)
    samples = [dataclasses.replace(s, arrival_offset_s=0.0) for s in users]
    samples.append(dataclasses.replace(long, arrival_offset_s=base._LONG_ARRIVAL_S.value))
    config = engine_replay.ReplayConfig(use_arrival_offsets=True)
    arms = {}
    for name, engine in engines.items():
        before = engine.get_stats()
        t0 = time.perf_counter()
        result = engine_replay.replay(engine, samples, config)
        arms[name] = base.arm_summary(result, num_users, base._LONG_ARRIVAL_S.value)
        after = engine.get_stats()
        assert after.num_compilations == before.num_compilations, "a step compiled after warm-up"
        if after.kv_transfer is not None:
            time.sleep(0.5)  # let the last transfer's timer land
            moved = engine.get_stats().kv_transfer
            arms[name]["transfers"] = {
                "count": moved.num_transfers, "blocks": moved.num_blocks, "bytes": moved.num_bytes,
                "ms_per_transfer": 1000 * moved.seconds / max(moved.num_landed, 1),
                "gb_per_s": moved.gb_per_s, "fallbacks": moved.num_fallbacks}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)

    co, pd = arms["colocated"], arms["disaggregated"]
    headers = ["arm", "users p50 ITL (ms)", "users p99 ITL (ms)", "users max ITL (ms)", "users TPOT p50 (ms)",
               "newcomer TTFT (ms)", "steps"]
    rows = [[n, a["users_itl_ms"]["p50"], a["users_itl_ms"]["p99"], a["users_itl_ms"]["max"],
             a["users_tpot_ms_p50"], a["newcomer_ttft_ms"], a["num_steps"]] for n, a in arms.items()]
    t = pd["transfers"]
    text = (f"{num_users} users ({users[0].prompt_len}-token prompts, {base._USER_OUTPUT_LEN.value} output tokens) "
            f"stream; a {long.prompt_len}-token prompt arrives at t = {base._LONG_ARRIVAL_S.value:g} s. "
            f"{engines['colocated'].model_name} on {report.environment()['platform']}, chunk budget {budget}, "
            f"buckets {buckets}.\n\n" + report.markdown_table(headers, rows) + "\n"
            + f"- users' max ITL colocated / disaggregated: "
              f"{report.ratio(co['users_itl_ms']['max'], pd['users_itl_ms']['max']):.2f}; p99: "
              f"{report.ratio(co['users_itl_ms']['p99'], pd['users_itl_ms']['p99']):.2f}; "
              f"newcomer TTFT disaggregated / colocated: {report.ratio(pd['newcomer_ttft_ms'], co['newcomer_ttft_ms']):.2f}\n"
            + f"- transfers: {t['count']} ({t['blocks']} blocks, {t['bytes'] / 1e6:.1f} MB), "
              f"{t['ms_per_transfer']:.1f} ms each from dispatch to landing, {t['gb_per_s']:.2f} GB/s, "
              f"{t['fallbacks']} fallbacks\n")
    print(text)
    goals = [report.goal("users' p99 ITL, colocated / disaggregated", report.ratio(
        co["users_itl_ms"]["p99"], pd["users_itl_ms"]["p99"]), 1.0)]
    summary = {"experiment": "disaggregation", "command": report.command_line(),
               "environment": report.environment(), "config": {**knobs, "token_buckets": buckets},
               "arms": arms, "goals": goals, "elapsed_s": time.perf_counter() - t_start}
    fig, (ax,) = report.new_figure(1, width=6.0)
    labels = ("users p99 ITL", "users max ITL", "newcomer TTFT")
    for k, (name, a) in enumerate(arms.items()):
        values = [a["users_itl_ms"]["p99"], a["users_itl_ms"]["max"], a["newcomer_ttft_ms"]]
        ax.bar([i + (k - 0.5) * 0.38 for i in range(3)], [v / 1000 for v in values], 0.38, label=name)
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("seconds")
    ax.legend()
    fig.suptitle(f"disaggregation: a {long.prompt_len}-token prompt among {num_users} streams")
    paths = report.write_results(base._OUT_DIR.value, _NAME.value, summary, text + report.goals_text(goals), fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
