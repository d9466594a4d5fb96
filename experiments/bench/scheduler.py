"""Time of Scheduler.schedule() + update() per step with N running requests (pure Python, CPU).

    python -m experiments.bench.scheduler [--num_running=256,1024 --num_steps=1000 ...]

For each N: N requests with prompts uniform in [prompt_len / 2, prompt_len] are added and
prefilled (untimed), then `num_steps` steady-state steps are timed, each a schedule() and an
update() with a fake StepResult built outside the timed region (the engine's work). With
--churn_every=k, every k-th step one running request is aborted and a new one added (untimed),
so the timed steps also include an admission and a prefill chunk. Every request decodes all the
way (ignore_eos, max_tokens beyond the run), so each step schedules N decodes; a block fills,
gets hashed and enters the prefix cache every block_size steps per request, as in serving.
Reported, in milliseconds: median and p90 of schedule+update in wall time (perf_counter), the
same in CPU time of this process (process_time: unaffected by other processes competing for the
cores, so the number to quote on a shared machine), and the wall medians of each half.
Goal on a 2-core CPU: under 1 ms at N=256 and under 4 ms at N=1024.
"""

from __future__ import annotations

import random
import statistics
import time

from absl import app, flags

from scheduler import Request, Scheduler, SchedulerConfig, StepResult
from scheduler.sliding_window import num_blocks_needed

FLAGS = flags.FLAGS
flags.DEFINE_list("num_running", ["256", "1024"], "Running-request counts to time.")
flags.DEFINE_integer("num_steps", 1000, "Timed steps per count.")
flags.DEFINE_integer("prompt_len", 512, "Longest prompt; prompts are uniform in [p/2, p].")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
flags.DEFINE_integer("max_num_batched_tokens", 8192, "Token budget per step.")
flags.DEFINE_bool("prefix_caching", True, "Enable the prefix cache (hashing of full blocks).")
flags.DEFINE_integer(
    "churn_every", 0, "Abort one request and add a new one every k steps (0: off)."
)
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("sliding_window", 0, "With > 0: sliding-window block accounting with this window "
                     "(a second block group, scheduler/sliding_window.py); 0: one group.")


def fake_result(output) -> StepResult:
    ids = [sr.req_id for sr in output.scheduled if sr.sample]
    return StepResult(ids, [[(hash(rid) + len(ids)) % 32000] for rid in ids])


def new_request(rng: random.Random, req_id: str, max_tokens: int) -> Request:
    prompt_len = rng.randint(FLAGS.prompt_len // 2, FLAGS.prompt_len)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    return Request(req_id, prompt, max_tokens, ignore_eos=True)


def bench(num_running: int) -> dict:
    rng = random.Random(FLAGS.seed)
    total_steps = (
        FLAGS.num_steps + 2 * FLAGS.prompt_len * num_running // FLAGS.max_num_batched_tokens
    )
    max_model_len = FLAGS.prompt_len + total_steps + 64
    blocks_per_seq = -(-max_model_len // FLAGS.block_size)
    config = SchedulerConfig(
        max_num_seqs=num_running,
        max_num_batched_tokens=max(FLAGS.max_num_batched_tokens, num_running),
        max_model_len=max_model_len,
        block_size=FLAGS.block_size,
        num_blocks=num_running * blocks_per_seq + 1,
        enable_prefix_caching=FLAGS.prefix_caching,
        **({} if not FLAGS.sliding_window else dict(
            sliding_window=FLAGS.sliding_window, num_sliding_blocks=num_blocks_needed(
                window=FLAGS.sliding_window, block_size=FLAGS.block_size, max_num_seqs=num_running,
                max_num_batched_tokens=max(FLAGS.max_num_batched_tokens, num_running),
                max_model_len=max_model_len))),
    )
    scheduler = Scheduler(config)
    max_tokens = max_model_len - FLAGS.prompt_len - 1
    for i in range(num_running):
        scheduler.add_request(new_request(rng, f"r{i}", max_tokens))
    # Untimed: prefill until every request decodes.
    while (
        any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.requests.values())
        or len(scheduler.running) < num_running
    ):
        output = scheduler.schedule()
        scheduler.update(output, fake_result(output))

    schedule_ms, update_ms, total_ms, cpu_ms, batch_sizes = [], [], [], [], []
    next_id = num_running
    for step in range(FLAGS.num_steps):
        if FLAGS.churn_every and step % FLAGS.churn_every == 0:
            scheduler.abort_request(next(iter(scheduler.running)))
            scheduler.add_request(new_request(rng, f"r{next_id}", max_tokens))
            next_id += 1
        c0, t0 = time.process_time(), time.perf_counter()
        output = scheduler.schedule()
        t1, c1 = time.perf_counter(), time.process_time()
        result = fake_result(output)
        c2, t2 = time.process_time(), time.perf_counter()
        scheduler.update(output, result)
        t3, c3 = time.perf_counter(), time.process_time()
        schedule_ms.append(1e3 * (t1 - t0))
        update_ms.append(1e3 * (t3 - t2))
        total_ms.append(1e3 * (t1 - t0 + t3 - t2))
        cpu_ms.append(1e3 * (c1 - c0 + c3 - c2))
        batch_sizes.append(len(output.scheduled))
    total_ms.sort()
    cpu_ms.sort()
    return {
        "num_running": num_running,
        "scheduled_per_step": statistics.median(batch_sizes),
        "median_ms": statistics.median(total_ms),
        "p90_ms": total_ms[int(0.9 * (len(total_ms) - 1))],
        "cpu_median_ms": statistics.median(cpu_ms),
        "cpu_p90_ms": cpu_ms[int(0.9 * (len(cpu_ms) - 1))],
        "schedule_median_ms": statistics.median(schedule_ms),
        "update_median_ms": statistics.median(update_ms),
        "num_preemptions": scheduler.stats.num_preemptions,
    }


def main(argv) -> None:
    del argv
    print(
        f"schedule()+update() per step, {FLAGS.num_steps} steps, block_size={FLAGS.block_size}, "
        f"prefix_caching={FLAGS.prefix_caching}, churn_every={FLAGS.churn_every}, "
        f"sliding_window={FLAGS.sliding_window or None}"
    )
    print(
        f"{'running':>8} {'sched/step':>10} {'median ms':>10} {'p90 ms':>8} {'cpu med ms':>11} "
        f"{'cpu p90 ms':>11} {'schedule ms':>12} {'update ms':>10}"
    )
    for n in FLAGS.num_running:
        r = bench(int(n))
        print(
            f"{r['num_running']:>8} {r['scheduled_per_step']:>10.0f} {r['median_ms']:>10.3f} "
            f"{r['p90_ms']:>8.3f} {r['cpu_median_ms']:>11.3f} {r['cpu_p90_ms']:>11.3f} "
            f"{r['schedule_median_ms']:>12.3f} {r['update_median_ms']:>10.3f}"
        )


if __name__ == "__main__":
    app.run(main)
