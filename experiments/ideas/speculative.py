"""Speculative decoding across the load curve: off / always on / automatic, per concurrency.

    python -m experiments.ideas.speculative --workload=rewrite --concurrencies=1,4,16 \\
        --num_requests=8 --output_len=96

1. One engine, compiled once for k drafts (`--num_speculative_tokens`, `--method`); the arms swap
   only its SpecDecoder (no recompile): `off` drafts nothing, `on` always drafts (no load or
   acceptance switch), `auto` uses the SpeculativeConfig defaults (both switches).
2. Workloads: `rewrite` asks the model to repeat a passage taken from ShareGPT replies (drafts from
   the prompt hit), `sharegpt` uses ShareGPT prompts as they are. Greedy, ignore_eos, `--output_len`
   new tokens per request. `--prefill=cached` (default) prefills every prompt once before the
   arms, so each arm finds them in the prefix cache and measures decoding; `uncached` turns
   prefix caching off and every arm prefills too.
3. For each concurrency c, a closed loop keeps c requests in flight until max(`--num_requests`, c)
   have finished; it records output tokens/s, the p95 inter-token
   latency (a step that emits several tokens of a request counts each at the average gap), and the
   speculation counters. The arms interleave per concurrency, so they share the machine's state;
   `--rounds=R` repeats the interleaved arms R times and reports each arm's median round.
4. Writes JSON, a markdown table and a plot (`--out_dir`: speculative_<workload>_<method>.*:
   throughput and p95 ITL per arm against concurrency), and prints the table, the speed-up of
   `on` and `auto` over `off` at each concurrency, the crossover (the first c where `on` loses to
   `off`), and whether `auto` reached 0.95x the better of `off` and `on` at every c.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
from absl import app, flags

from experiments.lab import report
from experiments.lab.speculative_summary import ArmResult, median_of_rounds, plot, summarize

_MODEL = flags.DEFINE_string("model", "default", "target model spec")
_METHOD = flags.DEFINE_enum("method", "ngram", ["ngram", "draft_model", "draft_head"], "proposer")
_DRAFT = flags.DEFINE_string("draft_model", None, "draft_model: the draft's model spec; draft_head: "
                             "the head's folder (default: DEFAULT_HEAD, trained once if missing)")
_K = flags.DEFINE_integer("num_speculative_tokens", 3, "k")
_WORKLOAD = flags.DEFINE_enum("workload", "rewrite", ["rewrite", "sharegpt"], "prompts")
_CONC = flags.DEFINE_list("concurrencies", ["1", "4", "16"], "requests in flight")
_ARMS = flags.DEFINE_list("arms", ["off", "on", "auto"], "arms, interleaved per concurrency")
_NUM = flags.DEFINE_integer("num_requests", 8, "requests per concurrency (at least c)")
_OUT_LEN = flags.DEFINE_integer("output_len", 96, "new tokens per request")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "max_num_seqs")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget")
_BUCKETS = flags.DEFINE_list("token_buckets", [], "token buckets (default: derived)")
_DTYPE = flags.DEFINE_string("dtype", None, "model dtype (default: the platform's, float32 on the CPU)")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "rounds per concurrency (arms interleaved in each); the "
                               "median round is reported")
_PREFILL = flags.DEFINE_enum("prefill", "cached", ["cached", "uncached"],
                             "cached: every prompt is prefilled once before the arms run, so each arm "
                             "measures decoding (what speculation changes); uncached: prefix caching off, "
                             "every arm prefills its prompts too")
_KV_BLOCKS = flags.DEFINE_integer("num_kv_blocks", None, "KV cache blocks (default: the engine's)")
_OUT_DIR = flags.DEFINE_string("out_dir", "experiments/results", "where the JSON and table go")

# The default model's draft head: trained once by experiments.train_draft and cached here.
DEFAULT_HEAD = "~/.cache/jaxserve/draft_heads/default"

REWRITE = ("Repeat the following passage exactly, word for word, and say nothing else.\n\n{}")


def _prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    from experiments.lab.datasets import iter_json_array, sharegpt_path

    texts = []
    for record in iter_json_array(sharegpt_path()):
        turns = record.get("conversations") or []
        if len(turns) < 2:
            continue
        text = turns[1 if workload == "rewrite" else 0].get("value", "")
        if 200 <= len(text) <= 700 and text.isascii():
            texts.append(text)
        if len(texts) == n:
            break
    out = []
    for text in texts:
        content = REWRITE.format(text) if workload == "rewrite" else text
        chat = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def _run_arm(engine, prompts, arm: str, c: int, spec_for) -> ArmResult:
    from engine.sampling_params import SamplingParams

    engine.spec = spec_for(arm)
    params = SamplingParams(temperature=0.0, max_tokens=_OUT_LEN.value, ignore_eos=True)
    total = max(_NUM.value, c)
    next_id, done, gaps, last = 0, 0, [], {}
    tokens = 0
    start = time.perf_counter()
    while done < total:
        while next_id < total and len(engine._requests) < c:
            rid = f"{arm}-{c}-{next_id}"
            engine.add_request(rid, prompts[next_id % len(prompts)], params)
            last[rid] = (time.perf_counter(), 0)
            next_id += 1
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            t0, n0 = last[out.request_id]
            if n0 and n > n0:  # inter-token gaps after the first token
                gaps += [(now - t0) / (n - n0)] * (n - n0)
            last[out.request_id] = (now, n)
            if out.finished:
                done += 1
                tokens += n
    seconds = time.perf_counter() - start
    stats = engine.spec.stats() if engine.spec is not None else None
    return ArmResult(arm, c, total, tokens, seconds, tokens / seconds,
                     1000 * float(np.percentile(gaps, 95)) if gaps else 0.0,
                     stats.acceptance_rate if stats else 0.0,
                     stats.mean_accepted_length if stats else 0.0,
                     stats.num_switch_offs if stats else 0)


def _cache_prompts(engine, prompts, max_concurrency: int) -> None:
    """Prefills every prompt once (one token each) so that every arm finds the same prompts in the
    prefix cache; without it the first arm at each concurrency prefilled what the later arms then
    found cached (off ran 1.4x slower in its first round than in its second). Checks that the
    cache holds them all beside the largest concurrency's own blocks, so no arm evicts another's."""
    from engine.sampling_params import SamplingParams

    block = engine.config.block_size
    need = sum(len(p) // block for p in prompts) + max_concurrency * (-(-(_OUT_LEN.value + block) // block))
    num_blocks = engine.scheduler.config.num_blocks
    if need > num_blocks:
        raise SystemExit(f"the cached prompts and {max_concurrency} running requests need {need} KV blocks, "
                         f"the cache has {num_blocks}: pass a larger --num_kv_blocks (or --prefill=uncached)")
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"cache-{i}", prompt, one)
    while engine.has_unfinished_requests():
        engine.step()


def ensure_head(folder: str, model: str) -> str:
    """The draft head's folder; trains it there first (experiments.train_draft, a few CPU minutes
    for the default model) when it holds no head yet."""
    import subprocess

    folder = os.path.expanduser(folder)
    if not os.path.exists(os.path.join(folder, "draft_head.json")):
        print(f"no draft head in {folder}: training one (python -m experiments.train_draft)", flush=True)
        subprocess.run([sys.executable, "-m", "experiments.train_draft", f"--model={model}", f"--out={folder}"],
                       check=True)
    return folder


def main(argv) -> None:
    del argv
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.spec_decode.base import make_spec_decoder
    from engine.speculative_config import SpeculativeConfig

    concurrencies = [int(c) for c in _CONC.value]
    draft = _DRAFT.value
    if _METHOD.value == "draft_head":
        draft = ensure_head(draft or DEFAULT_HEAD, _MODEL.value)
    spec = dict(method=_METHOD.value, num_speculative_tokens=_K.value, **({"model": draft} if draft else {}))
    knobs = dict(model=_MODEL.value, dtype=_DTYPE.value, max_num_seqs=_MAX_SEQS.value,
                 max_num_batched_tokens=_BUDGET.value, speculative_config=spec,
                 enable_prefix_caching=_PREFILL.value == "cached", num_kv_blocks=_KV_BLOCKS.value)
    if _BUCKETS.value:
        knobs["token_buckets"] = tuple(int(b) for b in _BUCKETS.value)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(**knobs))
    print(f"engine built in {time.perf_counter() - start:.1f} s", flush=True)
    proposer = engine.spec.proposer
    budget = engine.config.max_num_batched_tokens
    auto = SpeculativeConfig(**spec)
    always = dataclasses.replace(auto, disable_by_batch_size=None, disable_by_token_share=1.0,
                                 min_acceptance_rate=0.0)

    def spec_for(arm):
        if arm == "off":
            s = make_spec_decoder(auto, engine.runner, max_num_batched_tokens=budget, proposer=proposer)
            s.enabled = False
            return s
        return make_spec_decoder(always if arm == "on" else auto, engine.runner,
                                 max_num_batched_tokens=budget, proposer=proposer)

    prompts = _prompts(engine.tokenizer, _WORKLOAD.value, max(_NUM.value, max(concurrencies)))
    _run_arm(engine, prompts[:1], "on", 1, spec_for)  # warm-up
    if _PREFILL.value == "cached":
        _cache_prompts(engine, prompts, max(concurrencies))
    results = []
    for c in concurrencies:
        rounds = {arm: [] for arm in _ARMS.value}
        for _ in range(_ROUNDS.value):
            for arm in _ARMS.value:
                r = _run_arm(engine, prompts, arm, c, spec_for)
                rounds[arm].append(r)
                print(f"c={c:3d} {arm:4s} {r.tokens_per_s:7.2f} tok/s  itl_p95 {r.itl_p95_ms:7.1f} ms  "
                      f"accept {r.acceptance_rate:.2f}  mean_len {r.mean_accepted_length:.2f}", flush=True)
        results += [median_of_rounds(rounds[arm]) for arm in _ARMS.value]
    name = f"speculative_{_WORKLOAD.value}_{_METHOD.value}"
    summary, text = summarize(results, concurrencies)
    summary = {"command": report.command_line(), "method": _METHOD.value, "workload": _WORKLOAD.value,
               "prefill": _PREFILL.value,
               "k": _K.value, "model": _MODEL.value, "dtype": engine.dtype, **summary,
               "environment": report.environment()}
    print(text)
    report.write_results(_OUT_DIR.value, name, summary, text, plot(results, name))


if __name__ == "__main__":
    app.run(main)
