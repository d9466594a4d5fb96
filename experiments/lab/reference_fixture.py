"""The default model's reference fixture (transformers' float32 greedy continuations of the
fixture prompts, tests/fixtures/smollm2_reference.*) and a padded dense forward over it: shared by
experiments.bench.bf16_agreement and experiments.quant_quality."""

from __future__ import annotations

import json
import pathlib

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
PAD_TO = 128


def load_reference():
    """The fixture: (its JSON: prompts, token ids, versions; its arrays: logits and margins)."""
    import numpy as np

    meta = json.loads((FIXTURES / "smollm2_reference.json").read_text())
    return meta, np.load(FIXTURES / "smollm2_reference.npz")


def dense_logits(forward, params, ids: list[int]):
    """float32 logits [len(ids), vocab] of a jitted dense forward, the ids padded to PAD_TO
    (causal: padding after the end changes nothing, and a few lengths compile)."""
    import jax.numpy as jnp
    import numpy as np

    x = np.zeros(-(-len(ids) // PAD_TO) * PAD_TO, np.int32)
    x[: len(ids)] = ids
    return np.asarray(forward(params, jnp.asarray(x)).astype(jnp.float32))[: len(ids)]
