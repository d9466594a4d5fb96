"""Quantized configurations against float32 on the default model: greedy agreement and perplexity.

    python -m experiments.quant_quality [--configs=int8,int8-weight-only,fp8,kv-int8,kv-fp8_e4m3
                                         --near_tie=0.5 --ppl_tokens=512]

Each configuration is the float32 weights of the default model (the GGUF dequantized, as the
engine serves it) in the served layout, with its weights quantized (models/quant.py) and/or K and
V as an 8-bit cache would give them back (pallas_kernels/kv_quant.py), run by the dense forward
(models/llama.py forward_dense), teacher-forced as experiments.bench.bf16_agreement does (experiments/lab/reference_fixture.py):

- greedy agreement: over prompt + the reference continuation of each fixture prompt
  (transformers' float32 greedy, tests/fixtures/smollm2_reference.*), each position's argmax
  against the reference token, over all positions and over those whose reference top-2 margin is
  at least --near_tie (the bf16 report's margin); the first disagreement and its margin;
- perplexity: exp(mean next-token NLL) over a held-out text (the first `--ppl_tokens` tokens of
  ShareGPT answers, record after record, from the packaged file; no prompt of the benchmarks'
  fixed workload) as one sequence; reported as the ratio to float32's, and the mean KL divergence
  of each configuration's next-token distribution from float32's over the same positions (a
  steadier measure: the ratio on 512 tokens moves by about 1 % between equally good configurations).

Configurations (name: weights, activation form, KV):
  float32            the reference forward
  int8               int8 weights, activations quantized too (int8 x int8, a scale per row:
                     every product here has >= 2 rows, the form the CPU engine uses for its
                     buckets of 2 or more tokens)
  int8-g64           the same with a scale per 64 input channels of a row (models/quant.py
                     activation_group; not the engine's: slow on XLA:CPU)
  int8-weight-only   int8 weights, float activations (the CPU engine's one-row decode form)
  int8-smooth        int8 x int8 per row after SmoothQuant-style smoothing, alpha 0.5
                     (models/smoothing.py: calibrated on its CALIBRATION_TEXT);
                     NAME-smooth-A: a quantized configuration NAME smoothed with alpha A
                     (int8-smooth-0.6, int8-weight-only-smooth-0.5, ...)
  fp8                fp8 e4m3 weights, weight-only (the CPU's fp8 form)
  fp8-activations    fp8 weights and fp8 activations (the native fp8 x fp8 form of an H200)
  kv-int8            float32 weights, an int8 KV cache
  kv-fp8_e4m3        float32 weights, an fp8 KV cache
  int8+kv-int8       int8 weights (int8 x int8) and an int8 KV cache

The smoothed configurations calibrate once per run (the time is printed) and report the same
columns. BUILD_NOTES.md "Quantization" has the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from absl import app, flags

from experiments.lab.reference_fixture import dense_logits, load_reference


def define_flags() -> None:
    """Flags, defined only when run as a program (tests import this module beside
    experiments.bench.bf16_agreement, which defines --near_tie too)."""
    flags.DEFINE_list("configs", ["int8", "int8-weight-only", "fp8", "kv-int8", "kv-fp8_e4m3"],
                      "Configurations to compare with float32 (names in the module docstring).")
    flags.DEFINE_float("near_tie", 0.5, "A reference top-2 margin below this is a near-tie "
                       "(experiments.bench.bf16_agreement's default).")
    flags.DEFINE_integer("ppl_tokens", 512, "Tokens of held-out text for the perplexity.")
    flags.DEFINE_string("json", None, "Write the result here as JSON.")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    quantization: str | None = None
    activation_rows: int | None = None  # models/quant.py: 0 = every product quantizes activations
    activation_group: int | None = None  # models/quant.py: None = one activation scale per row
    kv_cache_dtype: str = "auto"
    smoothing: float | None = None  # models/smoothing.py alpha; None: not smoothed


CONFIGS = {
    "float32": QuantConfig(),
    "int8": QuantConfig("int8", 0),
    "int8-g64": QuantConfig("int8", 0, activation_group=64),
    "int8-weight-only": QuantConfig("int8", None),
    "fp8": QuantConfig("fp8", None),
    "fp8-activations": QuantConfig("fp8", 0),
    "kv-int8": QuantConfig(kv_cache_dtype="int8"),
    "kv-fp8_e4m3": QuantConfig(kv_cache_dtype="fp8_e4m3"),
    "int8+kv-int8": QuantConfig("int8", 0, kv_cache_dtype="int8"),
    "int8-smooth": QuantConfig("int8", 0, smoothing=0.5),
}


def config_named(name: str) -> QuantConfig:
    """CONFIGS[name], or NAME-smooth-A: configuration NAME smoothed with alpha A."""
    if name in CONFIGS:
        return CONFIGS[name]
    base, _, alpha = name.rpartition("-smooth-")
    if base in CONFIGS and CONFIGS[base].quantization is not None:
        try:
            return dataclasses.replace(CONFIGS[base], smoothing=float(alpha))
        except ValueError:
            pass
    raise ValueError(f"--configs: unknown {name}; known: {', '.join(CONFIGS)}, and a quantized one's "
                     "NAME-smooth-ALPHA (int8-smooth-0.6)")


def held_out_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first num_tokens tokens of ShareGPT's answers, record after record."""
    from experiments.lab.datasets import _sharegpt_pair, iter_json_array, sharegpt_path

    ids: list[int] = []
    for record in iter_json_array(sharegpt_path()):
        pair = _sharegpt_pair(record)
        if pair:
            ids += tokenizer.encode(pair[1].strip() + "\n\n", add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"ShareGPT holds fewer than {num_tokens} answer tokens")


class Evaluator:
    """The default model loaded once (float32, served layout, stacked layers); one jitted dense
    forward per configuration."""

    def __init__(self):
        from models.default_model import default_model_path
        from models.gguf_loader import load_gguf
        from models.served_layout import fuse_projections, stack_layers
        from text.tokenizer import tokenizer_from_gguf

        self.config, params, reader = load_gguf(default_model_path(), dtype="float32", progress=False)
        self.tokenizer = tokenizer_from_gguf(reader, str(default_model_path()))
        self.loader_params = stack_layers(params)
        self.params = fuse_projections(self.loader_params)
        self.meta, self.arrays = load_reference()
        self._maxima = None
        self.calibration_seconds = None

    def smoothed(self, alpha: float) -> dict:
        """The served layout smoothed with alpha (the calibration pass run once, timed)."""
        import time

        from models.served_layout import fuse_projections
        from models.smoothing import activation_maxima, calibration_ids, smooth_params

        if self._maxima is None:
            start = time.perf_counter()
            self._maxima = activation_maxima(self.loader_params, self.config, calibration_ids(self.tokenizer))
            self.calibration_seconds = time.perf_counter() - start
        return fuse_projections(smooth_params(self.loader_params, self.config, self._maxima, alpha))

    def forward(self, qc: QuantConfig):
        import jax

        from models.llama import forward_dense
        from models.quant import quantize_params

        params = self.params if qc.smoothing is None else self.smoothed(qc.smoothing)
        params = quantize_params(params, qc.quantization, activation_rows=qc.activation_rows,
                                 activation_group=qc.activation_group)
        jitted = jax.jit(lambda p, ids: forward_dense(p, self.config, ids, kv_cache_dtype=qc.kv_cache_dtype))
        return lambda ids: dense_logits(jitted, params, ids)

    def evaluate(self, qc: QuantConfig, *, prompts: Sequence[int] | None = None, text_ids=(),
                 near_tie: float = 0.5, reference_logprobs=None) -> dict:
        """Agreement on the fixture prompts (indices `prompts`, all by default) and the held-out
        NLL of `text_ids` (None when empty), with its next-token log-probabilities ("logprobs")
        and, given the reference's, the mean KL(reference || this) per position ("kl")."""
        import numpy as np

        run = self.forward(qc)
        margins_all = self.arrays["greedy_margins"]
        chosen = range(len(self.meta["prompts"])) if prompts is None else prompts
        rows, agree, clear, clear_agree = [], 0, 0, 0
        for i in chosen:
            prompt = self.meta["prompts"][i]
            ids, greedy = list(prompt["prompt_token_ids"]), list(prompt["greedy_token_ids"])
            logits = run(ids + greedy)
            predicted = np.argmax(logits[len(ids) - 1 : len(ids) - 1 + len(greedy)], axis=-1)
            hits = predicted == np.asarray(greedy)
            margins = margins_all[i][: len(greedy)]
            agree += int(hits.sum())
            clear += int((margins >= near_tie).sum())
            clear_agree += int((hits & (margins >= near_tie)).sum())
            first = next((s for s, h in enumerate(hits) if not h), None)
            rows.append({"prompt": prompt["name"], "agree": int(hits.sum()), "of": len(greedy),
                         "first_disagreement": first,
                         "margin_there": None if first is None else float(margins[first])})
        nll = kl = logprobs = None
        if len(text_ids):
            logits = run(list(text_ids))[:-1]
            logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
            logprobs = logits - logz[:, None]
            nll = float(-np.mean(logprobs[np.arange(len(logits)), np.asarray(text_ids[1:])]))
            if reference_logprobs is not None:
                kl = float(np.mean(np.sum(np.exp(reference_logprobs) * (reference_logprobs - logprobs), -1)))
        return {"positions": sum(r["of"] for r in rows), "agree": agree, "clear_positions": clear,
                "clear_agree": clear_agree, "near_tie": near_tie, "nll": nll, "kl": kl, "prompts": rows,
                "logprobs": logprobs}


def compare(names: Sequence[str], *, near_tie: float, ppl_tokens: int, prompts=None,
            evaluator: Evaluator | None = None) -> dict:
    configs = {name: config_named(name) for name in names}
    ev = evaluator or Evaluator()
    text = held_out_ids(ev.tokenizer, ppl_tokens)
    results, reference = {}, None
    for name in ["float32", *[n for n in names if n != "float32"]]:
        r = ev.evaluate(configs.get(name, CONFIGS["float32"]), prompts=prompts, text_ids=text, near_tie=near_tie,
                        reference_logprobs=reference)
        logprobs = r.pop("logprobs")
        reference = logprobs if reference is None else reference
        r["perplexity"] = math.exp(r["nll"])
        r["perplexity_ratio"] = r["perplexity"] / results["float32"]["perplexity"] if results else 1.0
        if ev.calibration_seconds is not None and configs.get(name, CONFIGS["float32"]).smoothing is not None:
            r["calibration_seconds"] = ev.calibration_seconds
        results[name] = r
    return results


def main(argv: Sequence[str]) -> None:
    del argv
    f = flags.FLAGS
    results = compare(f.configs, near_tie=f.near_tie, ppl_tokens=f.ppl_tokens)
    near = f.near_tie
    print(f"| config | agree (all) | agree (margin >= {near:g}) | perplexity | ratio to float32 | "
          "KL from float32 | first disagreements (step: reference margin) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        firsts = ", ".join(f"{p['prompt']} {p['first_disagreement']}: {p['margin_there']:.3f}"
                           for p in r["prompts"] if p["first_disagreement"] is not None) or "none"
        print(f"| {name} | {r['agree']}/{r['positions']} | {r['clear_agree']}/{r['clear_positions']} | "
              f"{r['perplexity']:.3f} | {r['perplexity_ratio']:.4f} | {r['kl'] or 0:.4f} | {firsts} |")
    if f.json:
        with open(f.json, "w") as out:
            json.dump(results, out, indent=1)
    seconds = [r["calibration_seconds"] for r in results.values() if "calibration_seconds" in r]
    if seconds:
        print(f"smoothing's calibration pass (models/smoothing.py activation_maxima, the default model "
              f"over CALIBRATION_TEXT, compile included): {seconds[0]:.2f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
