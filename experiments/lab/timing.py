"""Interleaved timing of compiled forms (the product-form benchmarks: experiments/bench/quant_forms.py,
q4_forms.py)."""

from __future__ import annotations

import statistics
import time


def median_ms(fns: dict, x, forms, repeats: int) -> dict[str, float]:
    """{form: median ms} of fns[form] = (fn, w) called as fn(w, x): each compiled first, then
    `repeats` rounds of every form in turn (so the forms share the machine's conditions)."""
    import jax

    for form in forms:
        fn, w = fns[form]
        jax.block_until_ready(fn(w, x))  # compile
    times = {form: [] for form in forms}
    for _ in range(repeats):
        for form in forms:
            fn, w = fns[form]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(w, x))
            times[form].append((time.perf_counter() - t0) * 1e3)
    return {form: statistics.median(t) for form, t in times.items()}
