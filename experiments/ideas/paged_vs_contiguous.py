"""Paged against contiguous KV allocation: KV memory wasted and how many requests fit at once.

    python -m experiments.ideas.paged_vs_contiguous [--num_prompts=1000 --num_kv_blocks=2049]

Scheduler-level: no model runs. The real `scheduler.Scheduler` plans every step and is fed a
fake `StepResult` (a fixed non-EOS token for each request it samples), so the block tables are
exactly the engine's; only the time axis is in steps rather than seconds.

1. Workload: ShareGPT prompts and answer lengths as they are (vLLM's filter: prompt <= 1024,
   prompt + answer <= 2048 tokens), all waiting at t = 0, ignore_eos.
2. The same KV pool (`--num_kv_blocks` blocks of `--block_size` tokens) and knobs for both arms;
   only `kv_allocation` differs: "paged" allocates a block when a request's tokens need one,
   "contiguous" reserves ceil(max_model_len / block_size) blocks per request at admission.
3. After every step, `Scheduler.kv_waste()`: slots held by running requests' tables against slots
   holding computed tokens. Waste % = sum of wasted slots / sum of allocated slots over all steps.
   Reported with the most and the mean number of requests running at once, the steps needed to
   finish the workload, and preemptions. Goals: paged waste < 5 %, contiguous > 50 %.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from absl import app, flags

from experiments.lab import datasets, report
from scheduler import Request, Scheduler, SchedulerConfig, StepResult

_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 1000, "ShareGPT requests.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 1024, "Drop longer ShareGPT prompts.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Longest sequence (the reservation).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_NUM_KV_BLOCKS = flags.DEFINE_integer("num_kv_blocks", 2049, "KV pool, null block included.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 256, "Most requests running at once.")
_MAX_NUM_BATCHED_TOKENS = flags.DEFINE_integer("max_num_batched_tokens", 2048, "Token budget.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling of ShareGPT records.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "paged_vs_contiguous", "Result file name (no extension).")

ARMS = ("paged", "contiguous")
_TOKEN = 1000  # what the fake model samples; never a stop token (requests ignore EOS)


def simulate(config: SchedulerConfig, lengths: Sequence[tuple[int, int]]) -> dict:
    """Runs (prompt_len, output_len) requests to completion; waste and occupancy per step."""
    scheduler = Scheduler(config)
    for i, (prompt_len, output_len) in enumerate(lengths):
        # Distinct prompts (no prefix sharing between requests), as ShareGPT's mostly are.
        prompt = [(i * 7919 + k) % 30000 + 1 for k in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, output_len, ignore_eos=True))
    allocated = token_slots = 0
    running, waste_pct = [], []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        ids = [sr.req_id for sr in out.scheduled if sr.sample]
        scheduler.update(out, StepResult(ids, [[_TOKEN] for _ in ids]))
        w = scheduler.kv_waste()
        allocated += w.num_allocated_slots
        token_slots += w.num_token_slots
        running.append(w.num_requests)
        waste_pct.append(100.0 * report.ratio(w.num_wasted_slots, w.num_allocated_slots))
    num_generated = sum(out_len for _, out_len in lengths)
    return {
        "waste_pct": 100.0 * report.ratio(allocated - token_slots, allocated),
        "wasted_slots_per_request": report.ratio(allocated - token_slots, sum(running)),
        "max_running": max(running),
        "mean_running": sum(running) / len(running),
        "num_steps": len(running),
        "tokens_per_step": num_generated / len(running),
        "num_preemptions": scheduler.stats.num_preemptions,
        "running_per_step": running,
        "waste_pct_per_step": [round(x, 2) for x in waste_pct],
    }


def kv_bytes_per_token() -> int:
    """float32 K and V of every layer of the default model (SmolLM2-135M), for scale."""
    from models.config import preset_config

    return preset_config("smollm2-135m").kv_bytes_per_token(itemsize=4)


def plot(arms: dict, title: str):
    fig, (ax_bar, ax_run, ax_waste) = report.new_figure(3, width=5.0)
    colors = {"paged": "tab:blue", "contiguous": "tab:orange"}
    names = list(arms)
    ax_bar.bar(names, [arms[n]["waste_pct"] for n in names], color=[colors[n] for n in names])
    for i, n in enumerate(names):
        ax_bar.text(i, arms[n]["waste_pct"], f"{arms[n]['waste_pct']:.1f}%", ha="center", va="bottom")
    ax_bar.set_ylabel("allocated KV slots holding no token (%)")
    ax_bar.set_title("KV waste")
    for n in names:
        ax_run.plot(arms[n]["running_per_step"], label=f"{n} (max {arms[n]['max_running']})",
                    color=colors[n])
        ax_waste.plot(arms[n]["waste_pct_per_step"], label=n, color=colors[n])
    ax_run.set_xlabel("step")
    ax_run.set_ylabel("requests running")
    ax_run.set_title("concurrent requests")
    ax_run.legend()
    ax_waste.set_xlabel("step")
    ax_waste.set_ylabel("waste (%)")
    ax_waste.set_title("waste per step")
    ax_waste.legend()
    fig.suptitle(title)
    return fig


def main(argv: Sequence[str]) -> None:
    del argv
    t_start = time.perf_counter()
    samples = datasets.load_sharegpt(datasets.default_tokenizer(), _NUM_PROMPTS.value, seed=_SEED.value,
                                     max_prompt_len=_MAX_PROMPT_LEN.value,
                                     max_total_len=_MAX_MODEL_LEN.value)
    lengths = [(s.prompt_len, s.expected_output_len) for s in samples]
    arms = {}
    for name in ARMS:
        config = SchedulerConfig(
            max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS.value,
            max_model_len=_MAX_MODEL_LEN.value, block_size=_BLOCK_SIZE.value,
            num_blocks=_NUM_KV_BLOCKS.value, enable_prefix_caching=False, kv_allocation=name)
        arms[name] = simulate(config, lengths)
    paged, contiguous = arms["paged"], arms["contiguous"]
    goals = [report.goal("paged KV waste (%)", paged["waste_pct"], 5.0, higher_is_better=False),
             report.goal("contiguous KV waste (%)", contiguous["waste_pct"], 50.0)]
    pool_tokens = (_NUM_KV_BLOCKS.value - 1) * _BLOCK_SIZE.value
    pool_mib = pool_tokens * kv_bytes_per_token() / 2**20
    headers = ["arm", "waste %", "wasted slots / request", "max running", "mean running",
               "steps", "tokens / step", "preemptions"]
    rows = [[n, a["waste_pct"], a["wasted_slots_per_request"], a["max_running"], a["mean_running"],
             a["num_steps"], a["tokens_per_step"], a["num_preemptions"]] for n, a in arms.items()]
    mean_len = sum(p + o for p, o in lengths) / len(lengths)
    text = (f"Scheduler-level simulation (the real Scheduler, a fake model): {len(lengths)} ShareGPT "
            f"requests (mean prompt + output {mean_len:.0f} tokens), max_model_len="
            f"{_MAX_MODEL_LEN.value}, a pool of {pool_tokens} token slots ({pool_mib:.0f} MiB of "
            f"float32 KV for SmolLM2-135M), max_num_seqs={_MAX_NUM_SEQS.value}.\n\n"
            + report.markdown_table(headers, rows) + "\n"
            + f"- paged fits {report.ratio(paged['max_running'], contiguous['max_running']):.1f}x "
              "as many concurrent requests at its peak\n" + report.goals_text(goals))
    print(text)
    summary = {
        "experiment": "paged_vs_contiguous", "command": report.command_line(),
        "level": "scheduler (fake model; steps, not seconds)",
        "config": {"num_prompts": len(lengths), "max_prompt_len": _MAX_PROMPT_LEN.value,
                   "max_model_len": _MAX_MODEL_LEN.value, "block_size": _BLOCK_SIZE.value,
                   "num_kv_blocks": _NUM_KV_BLOCKS.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                   "max_num_batched_tokens": _MAX_NUM_BATCHED_TOKENS.value, "seed": _SEED.value,
                   "pool_tokens": pool_tokens, "pool_mib_smollm2_f32": pool_mib},
        "workload": {"prompt_lens": [p for p, _ in lengths], "output_lens": [o for _, o in lengths]},
        "arms": arms, "goals": goals, "elapsed_s": time.perf_counter() - t_start,
    }
    fig = plot(arms, f"paged vs contiguous KV allocation (scheduler-level, {len(lengths)} ShareGPT requests)")
    paths = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
