"""Interleaved timing of compiled forms (the product-form benchmarks: experiments/bench/quant_forms.py,
q4_forms.py)."""

from __future__ import annotations

import statistics
import time


def median_ms(fns: dict, x, forms, repeats: int) -> dict[str, float]:
    """{form: median ms} of fns[form] = (fn, w) called as fn(w, x): each compiled first, then
    `repeats` rounds of every form in turn (so the forms share the machine's conditions), each
    timed call right after an untimed one of the same form: a serving engine runs one program step
    after step, and a call that follows another program ran slower than in that steady state (the
    float32 weight-first chain at 8 rows: 41.5 ms after the int8 weight-only form's call, 25.5 ms
    after its own; BUILD_NOTES.md "CPU attention forms", stop 48)."""
    import jax

    for form in forms:
        fn, w = fns[form]
        jax.block_until_ready(fn(w, x))  # compile
    times = {form: [] for form in forms}
    for _ in range(repeats):
        for form in forms:
            fn, w = fns[form]
            jax.block_until_ready(fn(w, x))  # the same program just before (untimed)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(w, x))
            times[form].append((time.perf_counter() - t0) * 1e3)
    return {form: statistics.median(t) for form, t in times.items()}
