"""bfloat16 greedy against the float32 reference on the fixture prompts (the speed issue's point 2).

    python -m experiments.bench.bf16_agreement [--near_tie=0.5]

The reference is Hugging Face transformers' float32 greedy continuation of each fixture prompt
(tests/fixtures/smollm2_reference.*, 16 tokens each). One dense bfloat16 forward of the served
layout over prompt + continuation gives every position's argmax (teacher forcing). Reported: the
positions where bfloat16 picks the reference's token, over all positions and over those whose
reference top-2 margin is at least --near_tie, and for each prompt the first step where a naive
bfloat16 greedy loop would leave the reference (the first disagreement) with its margin.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from experiments.lab.reference_fixture import dense_logits, load_reference


def define_flags() -> None:
    """Defined only when run as a program (tests import this module beside others)."""
    flags.DEFINE_float("near_tie", 0.5, "A reference top-2 margin below this is a near-tie.")


def agreement(near_tie: float) -> dict:
    import jax
    import numpy as np

    from models.default_model import default_model_path
    from models.gguf_loader import load_gguf
    from models.llama import forward_dense
    from models.served_layout import fuse_projections, stack_layers

    meta, arrays = load_reference()
    margins_all = arrays["greedy_margins"]
    config, params, _ = load_gguf(default_model_path(), dtype="bfloat16", progress=False)
    params = fuse_projections(stack_layers(params))
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    rows, same, clear, clear_same = [], 0, 0, 0
    for i, prompt in enumerate(meta["prompts"]):
        ids, greedy = list(prompt["prompt_token_ids"]), list(prompt["greedy_token_ids"])
        logits = dense_logits(forward, params, ids + greedy)
        predicted = [int(np.argmax(logits[len(ids) - 1 + s])) for s in range(len(greedy))]
        hits = [p == t for p, t in zip(predicted, greedy)]
        margins = margins_all[i][: len(greedy)]
        same += sum(hits)
        clear += int(np.sum(margins >= near_tie))
        clear_same += sum(h for h, m in zip(hits, margins) if m >= near_tie)
        first = next((s for s, h in enumerate(hits) if not h), None)
        rows.append({"prompt": prompt["name"], "agree": sum(hits), "of": len(greedy), "first_disagreement": first,
                     "margin_there": None if first is None else float(margins[first])})
    total = sum(r["of"] for r in rows)
    return {"positions": total, "agree": same, "clear_positions": clear, "clear_agree": clear_same,
            "near_tie": near_tie, "prompts": rows}


def main(argv: Sequence[str]) -> None:
    del argv
    result = agreement(flags.FLAGS.near_tie)
    for r in result["prompts"]:
        first = "none" if r["first_disagreement"] is None else (
            f"step {r['first_disagreement']} (reference margin {r['margin_there']:.3f})")
        print(f"{r['prompt']}: {r['agree']}/{r['of']} agree; first disagreement: {first}")
    print(f"all positions: {result['agree']}/{result['positions']}; positions with a reference margin >= "
          f"{result['near_tie']:g}: {result['clear_agree']}/{result['clear_positions']}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
