"""Many LoRA adapters in one batch: decode throughput and inter-token latency against the base.

    python -m experiments.exp_lora [--num_requests=32 --adapters=0,1,4,16 --lora_products=masked]

1. Workload: `--num_requests` requests (random prompts of `--prompt_len` tokens, `--output_len`
   tokens each, greedy, ignore_eos), all submitted at once, so after the prefill steps every step
   is a decode step of the whole batch. Adapters: `max(--adapters)` random PEFT adapters of rank
   `--rank` on every module (q/k/v/o/gate/up/down), written to a temporary folder.
2. Arms: the base model alone (an engine without LoRA); then engines with `max_loras` =
   max(--adapters) slots of rank `--max_lora_rank`, one per product form (`--lora_products`,
   models/lora.py): the first form with the requests spread round-robin over 0, 1, 4, 16 distinct
   adapters (0: every row the base model, in the LoRA engine: the fixed-shape products still
   run), with `--lora_rank_buckets` the first form again with those rank buckets at every count
   (its steps compute only up to their adapters' rank; none at 0 adapters), the other forms at
   16. All engines are built first; the arms run interleaved,
   `--repeats` times, and each arm reports its medians.
3. Reported per arm: decode throughput (output tokens of the decode steps / their time), the
   median decode step, p50/p95 inter-token latency (gaps between a request's tokens), and each
   arm's decode step over the base's. Goal (issue 31): 16 adapters in a batch of 32 within 1.5x
   of the base on the CPU.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from experiments.lab import report

_MODEL = flags.DEFINE_string("model", "default", "Base model.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "Requests in the batch (max_num_seqs).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 24, "Output tokens per request.")
_ADAPTERS = flags.DEFINE_list("adapters", ["0", "1", "4", "16"], "Distinct adapters per arm.")
_RANK = flags.DEFINE_integer("rank", 8, "Rank of the random adapters.")
_MAX_LORA_RANK = flags.DEFINE_integer("max_lora_rank", 16, "Slot rank (adapters are padded to it).")
_PRODUCTS = flags.DEFINE_list("lora_products", ["auto", "masked", "gather", "ragged"],
                              "Product forms: the first at every adapter count, the others at the most.")
_RANK_BUCKETS = flags.DEFINE_list("lora_rank_buckets", [], "LoRA rank buckets (EngineConfig.lora_rank_buckets, "
                                  "e.g. 0,8,16): the first product form also runs with them, at every "
                                  "adapter count (empty: not run).")
_PAIRED = flags.DEFINE_integer("paired_rounds", 0, "Also a paired run of this many decode rounds: the base "
                               "and the LoRA engines decode their batches at once, one step each per round "
                               "(rotating order), and each step is compared with the base's of its round "
                               "(0: not run).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs of each arm, interleaved (medians over them).")
_SEED = flags.DEFINE_integer("seed", 0, "Prompts and adapter weights.")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "Where results go.")
_NAME = flags.DEFINE_string("name", "exp_lora", "Result file name (no extension).")

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(folder: str, config, count: int, rank: int, seed: int) -> list[str]:
    """`count` random PEFT folders (every module, rank `rank`)."""
    import json
    import os

    from safetensors.numpy import save_file

    from models.lora import TARGET_MODULES, module_shape

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        tensors = {}
        for layer in range(config.num_layers):
            for module in MODULES:
                out, inp = module_shape(config, module)
                name = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module][2]}.{module}"
                tensors[f"{name}.lora_A.weight"] = rng.normal(0, inp ** -0.5, (rank, inp)).astype(np.float32)
                tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.01, (out, rank)).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}, f)
        paths.append(path)
    return paths


def run_arm(engine, prompts, loras) -> dict:
    """One batch; loras[i] is request i's LoRARequest or None."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_OUTPUT_LEN.value, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", prompt, params, **({"lora_request": lora} if lora is not None else {}))
    times: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    seen = dict.fromkeys(times, 0)
    decode_steps, decode_tokens = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        new = 0
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            times[out.request_id] += [end] * (n - seen[out.request_id])
            new += n - seen[out.request_id]
            seen[out.request_id] = n
        if all(len(t) >= 1 for t in times.values()) and new:  # every request past its prefill
            decode_steps.append(end - start)
            decode_tokens += new
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    return {"decode_step_ms_p50": 1e3 * statistics.median(decode_steps),
            "decode_tok_s": decode_tokens / sum(decode_steps),
            "itl_ms_p50": 1e3 * float(np.percentile(gaps, 50)), "itl_ms_p95": 1e3 * float(np.percentile(gaps, 95)),
            "num_decode_steps": len(decode_steps)}


def run_paired(arms, prompts, rounds: int) -> dict:
    """arms: [(name, engine, loras)], the first the base; every engine holds its own batch and they
    step in turns, one step each per round, so a slow phase of a shared machine hits a round's
    steps alike. Per arm: the median decode step and the median over rounds of its step / the
    base's step of the same round."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=rounds + 1, ignore_eos=True)
    pending = {}
    for name, engine, loras in arms:
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(f"paired{i}", prompt, params, **({"lora_request": lora} if lora is not None else {}))
        pending[name] = set(range(len(prompts)))  # requests without a token yet (prefilling)
    steps: dict[str, dict[int, float]] = {name: {} for name, _, _ in arms}
    r = 0
    while any(engine.has_unfinished_requests() for _, engine, _ in arms):
        for name, engine, _ in arms[r % len(arms):] + arms[: r % len(arms)]:
            if not engine.has_unfinished_requests():
                continue
            decoding = not pending[name]
            start = time.perf_counter()
            outputs = engine.step()
            if decoding:
                steps[name][r] = time.perf_counter() - start
            for out in outputs:
                pending[name].discard(int(out.request_id.removeprefix("paired")))
        r += 1
    base = steps[arms[0][0]]
    return {name: {"decode_step_ms_p50": 1e3 * statistics.median(s.values()),
                   "step_vs_base_paired": statistics.median(s[i] / base[i] for i in s if i in base),
                   "num_rounds": sum(i in base for i in s)} for name, s in steps.items()}


def median_arm(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: Sequence[str]) -> None:
    del argv
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.lora_config import LoRARequest
    from engine.step.model_runner import num_backend_compilations

    t_start = time.perf_counter()
    n = _NUM_REQUESTS.value
    counts = [int(c) for c in _ADAPTERS.value]
    products = list(_PRODUCTS.value)
    knobs = dict(model=_MODEL.value, max_num_seqs=n, max_num_batched_tokens=256, max_model_len=128,
                 token_buckets=(n, 256), seq_buckets=(n,), num_kv_blocks=n * 8 + 1, prompt_scoring_bucket=False)
    engines = {"base": LLMEngine(EngineConfig(**knobs), progress=False)}
    base = engines["base"]
    rng = np.random.default_rng(_SEED.value)
    prompts = [rng.integers(10, base.runner.sample_vocab_size, _PROMPT_LEN.value).tolist() for _ in range(n)]
    folder = tempfile.TemporaryDirectory()
    paths = write_adapters(folder.name, base.model_config, max(counts), _RANK.value, _SEED.value)
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    for product in products:
        engines[product] = LLMEngine(EngineConfig(**knobs, enable_lora=True, max_loras=max(counts),
                                                  max_lora_rank=_MAX_LORA_RANK.value, max_cpu_loras=max(counts),
                                                  lora_product=product), progress=False)
    ranks = tuple(int(r) for r in _RANK_BUCKETS.value)
    ranked = f"{products[0]} + rank buckets {','.join(map(str, ranks))}"
    if ranks:
        engines[ranked] = LLMEngine(EngineConfig(**knobs, enable_lora=True, max_loras=max(counts),
                                                 max_lora_rank=_MAX_LORA_RANK.value, max_cpu_loras=max(counts),
                                                 lora_product=products[0], lora_rank_buckets=ranks), progress=False)
    # Arms: the base alone; the first product at every adapter count (and with rank buckets); the
    # others at the most.
    plan = [("base (no LoRA)", "base", 0)] + [(f"{products[0]}, {c} adapters", products[0], c) for c in counts]
    if ranks:
        plan += [(f"{ranked}, {c} adapters", ranked, c) for c in counts]
    plan += [(f"{p}, {max(counts)} adapters", p, max(counts)) for p in products[1:]]
    for name, engine in engines.items():  # warm-up (and every adapter read into host memory)
        run_arm(engine, prompts[:2], [None, None] if name == "base" else [requests[0], None])
        if name != "base":
            for r in requests:
                engine.lora_manager.resolve(r)
    before = num_backend_compilations()
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in plan}
    for _ in range(_REPEATS.value):  # arms interleaved, so a slow phase of the machine hits them alike
        for name, engine_name, count in plan:
            loras = [requests[i % count] if count else None for i in range(n)]
            runs[name].append(run_arm(engines[engine_name], prompts, loras))
            print(name, runs[name][-1], flush=True)
    paired = {}
    if _PAIRED.value:
        top = max(counts)
        for count in sorted({0, top}):  # one batch per engine at a time: a pass per adapter count
            loras = [requests[i % count] if count else None for i in range(n)]
            arms_p = [("base (no LoRA)", base, [None] * n), (f"{products[0]}, {count} adapters", engines[products[0]], loras)]
            if ranks:
                arms_p.append((f"{ranked}, {count} adapters", engines[ranked], loras))
            for name, result in run_paired(arms_p, prompts, _PAIRED.value).items():
                paired[f"{name} (pass {count})" if name.startswith("base") else name] = result
                print("paired", name, result, flush=True)
    compiles = num_backend_compilations() - before
    folder.cleanup()
    arms = {name: median_arm(r) for name, r in runs.items()}
    base_step = arms["base (no LoRA)"]["decode_step_ms_p50"]
    for a in arms.values():
        a["step_vs_base"] = a["decode_step_ms_p50"] / base_step
    headers = ["arm", "decode step p50 (ms)", "x base", "decode tok/s", "ITL p50 (ms)", "ITL p95 (ms)", "decode steps"]
    rows = [[name, a["decode_step_ms_p50"], a["step_vs_base"], a["decode_tok_s"], a["itl_ms_p50"], a["itl_ms_p95"],
             a["num_decode_steps"]] for name, a in arms.items()]
    # The goal is judged on the paired ratios when they were measured (the arms' medians move with
    # the machine's load between arms), on the arms' otherwise.
    judged, key, how = (paired, "step_vs_base_paired", "paired") if paired else (arms, "step_vs_base", "arms")
    tops = [f"{_PRODUCTS.value[0]}, {max(counts)} adapters"] + ([f"{ranked}, {max(counts)} adapters"] if ranks else [])
    goals = [report.goal(f"decode step, {top} / base ({how})", judged[top][key], 1.5, higher_is_better=False)
             for top in tops]
    text = (f"{n} requests, prompts of {_PROMPT_LEN.value} tokens, {_OUTPUT_LEN.value} output tokens each "
            f"(greedy); adapters rank {_RANK.value} on every module, slots of rank {_MAX_LORA_RANK.value}, "
            f"max_loras {max(counts)}; model {_MODEL.value} on {report.environment()['platform']}; "
            f"medians of {_REPEATS.value} interleaved runs; compilations while the arms ran: {compiles}.\n\n"
            + report.markdown_table(headers, rows) + "\n" + report.goals_text(goals))
    if paired:
        text += (f"\nPaired ({_PAIRED.value} decode rounds: the engines decode their batches at once, one step "
                 "each per round, each compared with the base's step of its round):\n\n"
                 + report.markdown_table(["arm", "decode step p50 (ms)", "x base (median of per-round ratios)",
                                          "rounds"],
                                         [[k, v["decode_step_ms_p50"], v["step_vs_base_paired"], v["num_rounds"]]
                                          for k, v in paired.items()]))
    print(text)
    summary = {"experiment": "exp_lora", "command": report.command_line(), "environment": report.environment(),
               "config": {"num_requests": n, "prompt_len": _PROMPT_LEN.value, "output_len": _OUTPUT_LEN.value,
                          "adapters": counts, "rank": _RANK.value, "max_lora_rank": _MAX_LORA_RANK.value,
                          "lora_products": _PRODUCTS.value, "lora_rank_buckets": list(ranks),
                          "paired_rounds": _PAIRED.value,
                          "repeats": _REPEATS.value, "model": _MODEL.value},
               "arms": arms, "paired": paired, "compilations_during_arms": compiles, "goals": goals,
               "elapsed_s": time.perf_counter() - t_start}
    fig, (ax,) = report.new_figure(1, width=7)
    names = list(arms)
    ax.bar(range(len(names)), [arms[k]["decode_step_ms_p50"] for k in names], color="tab:blue")
    ax.axhline(1.5 * base_step, color="tab:red", linestyle="--", label="1.5x base")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("decode step p50 (ms)")
    ax.legend()
    fig.suptitle(f"LoRA: {n} requests, decode step per arm")
    paths_out = report.write_results(_OUT_DIR.value, _NAME.value, summary, text, fig)
    print("wrote " + ", ".join(str(p) for p in paths_out.values()))


if __name__ == "__main__":
    app.run(main)
