"""KV waste, paged against contiguous, on the same random mix (run with -s to see the numbers).

Waste = slots held by running requests' block tables minus slots holding computed tokens, summed
after every step. Paged tables grow a block at a time, so each request wastes less than a block;
a contiguous reservation of max_model_len mostly sits empty when sequences are short.
"""

from __future__ import annotations

import random

from scheduler import Request, Scheduler, SchedulerConfig

BLOCK_SIZE = 16


def run_mix(kv_allocation: str, fake_step) -> dict:
    config = SchedulerConfig(
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        num_blocks=1025,
        kv_allocation=kv_allocation,
    )
    scheduler = Scheduler(config)
    rng = random.Random(0)
    for i in range(120):
        prompt_len, output_len = rng.randint(1, 300), rng.randint(1, 300)
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, output_len, ignore_eos=True))
    allocated = token_slots = request_steps = worst = 0
    while scheduler.has_unfinished_requests():
        fake_step(scheduler)
        waste = scheduler.kv_waste()
        allocated += waste.num_allocated_slots
        token_slots += waste.num_token_slots
        request_steps += waste.num_requests
        if waste.num_requests:
            worst = max(worst, waste.num_wasted_slots / waste.num_requests)
    return {
        "wasted_per_request": (allocated - token_slots) / request_steps,
        "worst_step_per_request": worst,
        "wasted_fraction": (allocated - token_slots) / allocated,
    }


def test_paged_wastes_under_a_block_contiguous_over_half(fake_step):
    paged = run_mix("paged", fake_step)
    contiguous = run_mix("contiguous", fake_step)
    for name, r in (("paged", paged), ("contiguous", contiguous)):
        print(
            f"\n{name:>10}: {r['wasted_per_request']:.1f} wasted slots per running request "
            f"(worst step {r['worst_step_per_request']:.1f}), "
            f"{100 * r['wasted_fraction']:.1f}% of allocated slots wasted"
        )
    assert paged["worst_step_per_request"] < BLOCK_SIZE
    assert contiguous["wasted_fraction"] > 0.5
