"""Profiles the fixed workload's steps: per bucket, where a step's wall time goes.

    python -m experiments.bench.profile_step [--dtypes=float32,bfloat16 --num_requests=1,32 --output_len=128]

The flags are experiments.bench.offline's (the fixed workload: 4 short chat prompts cycled to N
requests, greedy, ignore_eos, all submitted at once to LLM.generate); one profiled run per dtype
and N after a warm-up. The phases and the host share are experiments/lab/step_profiler.py's.
`python -m experiments.bench.offline --dataset=fixed --profile` prints the same after its timed runs.
"""

from __future__ import annotations

from absl import app

from experiments.bench import offline as bench_offline
from experiments.lab.step_profiler import StepProfiler


def main(argv) -> None:
    del argv
    counts = [int(x) for x in bench_offline._NUM_REQUESTS.value]
    for dtype in bench_offline._DTYPES.value or [None]:
        llm = bench_offline.build_llm(dtype, max_num_seqs=max(counts + [bench_offline._MAX_NUM_SEQS.value]))
        for n in counts:
            prompts = bench_offline.fixed_prompts(llm.engine.tokenizer, n, bench_offline._PROMPT_LEN.value)
            bench_offline.run_generate(llm, prompts[:2], 4)  # warm-up
            profiler = StepProfiler().attach(llm.engine)
            r = bench_offline.run_generate(llm, prompts, bench_offline._OUTPUT_LEN.value)
            del llm.engine.step  # detach
            print(f"\n{llm.engine.dtype}, {n} requests x {bench_offline._OUTPUT_LEN.value} tokens: "
                  f"{r['output_tokens_per_s']:.1f} tok/s while profiled (medians, ms)")
            print(profiler.table())


if __name__ == "__main__":
    app.run(main)
