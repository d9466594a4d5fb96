"""Expert load imbalance per step of a mixture-of-experts model (bench_offline --expert_load).

An engine built inside a models/moe.ExpertLoadRecorder has the recorder called back by every MoE
layer of every step with the assignments per expert over the step's real tokens (padding left
out). For one run of N requests this module groups those records by engine step and summarizes:

- a layer's imbalance in a step: its most loaded expert's assignments / the mean over experts
  (tokens * k / E); 1 is perfectly even, E / k is the most uneven possible (every token's k
  choices on the same k experts), and a step of t tokens cannot go below E / (t * k) rounded
  up over the mean: a lone decode token of a top-2-of-8 model is always 4;
- a step's imbalance: the mean over its layers (the worst layer is reported too), since the
  step waits on every layer's most loaded expert where experts run in parallel;
- over the run: the median, 90th percentile and maximum of the steps' imbalance (the maximum
  also over the steps of at least the median token count only: the last steps of a run, a few
  stragglers' decodes, hit the floor of their few tokens), the median floor (the most even
  split a step's token count allows), and the run-long imbalance (each layer's loads summed
  over the steps: the router's bias, not the per-step noise).
"""

from __future__ import annotations

import numpy as np


def step_loads(records: list[tuple[int, np.ndarray]], num_layers: int) -> list[np.ndarray]:
    """The (layer, counts [E]) records of one engine step (in arrival order) -> one [L, E] array
    per device step it ran (a step may run more than one, e.g. with drafts)."""
    if len(records) % num_layers:
        raise ValueError(f"{len(records)} expert-load records is not a multiple of {num_layers} layers")
    out = []
    for i in range(0, len(records), num_layers):
        chunk = dict(records[i:i + num_layers])
        if sorted(chunk) != list(range(num_layers)):
            raise ValueError(f"expert-load records of layers {sorted(chunk)} in one step, expected 0..{num_layers - 1}")
        out.append(np.stack([chunk[j] for j in range(num_layers)]))
    return out


def imbalance(loads: np.ndarray) -> np.ndarray:
    """[..., E] loads -> max / mean over the experts (nan where nothing was routed)."""
    loads = np.asarray(loads, np.float64)
    mean = loads.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, loads.max(axis=-1) / mean, np.nan)


def summarize(steps: list[np.ndarray], k: int) -> dict:
    """The per-step [L, E] loads of a run -> the numbers the bench reports."""
    steps = [s for s in steps if s.sum() > 0]
    if not steps:
        raise ValueError("no step routed a token: nothing to summarize")
    per_layer = [imbalance(s) for s in steps]  # [L] each
    per_step = np.array([float(np.mean(x)) for x in per_layer])
    tokens = np.array([int(s[0].sum()) // k for s in steps])
    num_experts = steps[0].shape[1]
    # The most even a step of t tokens can be: ceil(t k / E) over the mean t k / E.
    floor = np.ceil(tokens * k / num_experts) / (tokens * k / num_experts)
    full = tokens >= np.median(tokens)  # leaves out the tail steps of a few stragglers
    total = np.sum(steps, axis=0)  # [L, E]
    return {
        "steps": len(steps),
        "tokens_per_step_median": float(np.median(tokens)),
        "imbalance_median": float(np.median(per_step)),
        "imbalance_p90": float(np.percentile(per_step, 90)),
        "imbalance_max_full_steps": float(per_step[full].max()),
        "imbalance_max": float(per_step.max()),
        "even_floor_median": float(np.median(floor)),
        "worst_layer_max": float(max(x.max() for x in per_layer)),
        "run_imbalance": float(np.mean(imbalance(total))),
        "per_step": [{"tokens": int(t), "imbalance": float(i)} for t, i in zip(tokens, per_step, strict=True)],
    }


def recorded_run(llm, recorder, run, num_layers: int) -> list[np.ndarray]:
    """Runs `run()` (which drives llm.generate) with every engine step's records grouped."""
    steps: list[np.ndarray] = []
    engine = llm.engine
    real_step = engine.step
    recorder.take()

    def step():
        outputs = real_step()
        steps.extend(step_loads(recorder.take(), num_layers))
        return outputs

    engine.step = step
    try:
        run()
    finally:
        del engine.step  # back to the class's step
    return steps
