"""On the CPU, the form each float or int8 x int8 product of a bucket takes, measured on the machine.

XLA:CPU runs a float32 or bfloat16 out-major product x . w^T of 2+ rows either as written
(YNNPACK packs the weight on every call) or weight-first, y^T = w . x^T (it packs the rows of
activations instead; models/weight_first.py). Which is faster depends on the machine, the dtype
and the row count: float32 at 32 rows was 1.38x faster weight-first on stop 48's AMD EPYC and
1.19x slower on stop 50's Intel Xeon, where 8 rows were 1.38x faster weight-first (BUILD_NOTES.md
"CPU attention forms", stop 50). An int8 weight's product that quantizes its activations
(models/int8_dot.py) has the same two forms: as written (u8 x s8, YNNPACK packing the weight) or
weight-first (s8 x s8, y^T = q . xq^T); on stop 51's Intel Xeon the bfloat16 default model's
int8 products as served took 13.1 ms weight-first against 16.1 ms as written at 8 rows. `EngineConfig.cpu_product_form` says
how an engine on the CPU chooses:

  measured      (default) at start-up, for every row count from 2 to MEASURE_MAX_ROWS that a
                bucket's products run (its tokens, its logit rows), both forms of the served
                model's own product weights in a chain (every layer's products, then the lm_head)
                are timed, and the faster one is lowered; so are its int8 x int8 products (the
                int8 weights' chain, at the row counts that quantize activations; their static
                form is u8 x s8 as written). Only where those weights are at least
                MEASURE_MIN_BYTES: a smaller model's products run from the caches, and its
                buckets keep the static rule (so do row counts past MEASURE_MAX_ROWS, and the
                rest once the time budget is spent). Each measurement is kept in
                `product_forms.json` beside the compilation cache folder in use, per machine,
                jax version, XLA_FLAGS, dtype, weight shapes and rows: a restart reads it.
  static        models/weight_first.py's rule (float32 from 2 rows, bfloat16 from 2 to 64).
  weight_first  every float product of 2+ rows weight-first (int8 x int8: the static form).
  plain         every float product as written (int8 x int8: the static form).

The forms compute the same dot products summed in another order: float32 rounding differs,
nothing else (int8 x int8 sums in int32: both forms exact, equal). Other platforms lower the
plain product whatever this says (the weight-first forms are CPU-only); an engine on a mesh is
not measured and keeps the static rule.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import CPU_PRODUCT_FORMS
from engine.step.cpu_compile import cpuinfo
from models.layer_loops import SERVED_PRODUCTS
from models.layers import proj
from models.quant import QuantizedWeight
from models.weight_first import FLOAT_DTYPES, out_major, static_rule
from models.weight_first import product_forms as lowering_forms

logger = logging.getLogger("jaxserve")

MEASURE_MAX_ROWS = 64  # row counts past this keep the static rule (prefill: both forms near)
MEASURE_MIN_BYTES = 64 << 20  # smaller models keep the static rule (their weights stay cached)
BUDGET_SECONDS = 30.0  # measuring stops once it has taken this long; the rest keep the rule
REPEATS = 5  # timed calls of each form per row count, alternated, after one untimed call each
SPEC = "te,ne->tn"  # the out-major product every measured weight takes

_SEEN: dict[str, dict] = {}  # measurements made or read by this process, by key


def product_weights(params: dict) -> list[jax.Array]:
    """The served model's 2-D float out-major product weights in step order: every layer's
    products (the CPU's per-layer buffers, models/layer_loops.py SERVED_PRODUCTS), then the
    lm_head (an untied output_proj, or the tied embedding). Empty for stacked layers."""
    layers = params.get("layers")
    if not isinstance(layers, list):
        return []
    weights = [layer[name] for layer in layers for name in SERVED_PRODUCTS
               if isinstance(layer.get(name), jax.Array) and layer[name].ndim == 2]
    if isinstance(params.get("output_proj"), jax.Array):
        weights.append(params["output_proj"])
    elif "lm_head" not in params and isinstance(params.get("embed"), jax.Array):
        weights.append(params["embed"])
    return [w for w in weights if jnp.dtype(w.dtype).name in FLOAT_DTYPES and out_major(SPEC, w.shape)]


def int8_weights(params: dict) -> list[QuantizedWeight]:
    """The served model's int8 weights whose products of 2+ rows quantize their activations
    (int8 x int8, models/int8_dot.py), in step order as `product_weights`. Empty for stacked
    layers."""
    layers = params.get("layers")
    if not isinstance(layers, list):
        return []
    weights = [layer[name] for layer in layers for name in SERVED_PRODUCTS if name in layer]
    weights += [params[name] for name in ("output_proj", "embed") if name in params][:1]
    return [w for w in weights if isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8 and w.q.ndim == 2
            and w.block is None and w.activation_rows is not None and w.activation_group is None]


def _chain(weight_first: bool):
    """jit(weights, inputs by width) -> a scalar: each weight's product in turn (models/layers.py
    proj, as a step lowers it, under a table naming the form), each fed a value of the one before
    (so none runs early or is skipped). An int8 weight (QuantizedWeight) takes
    rows of the model's dtype through its product as served (the rows quantized, the int8 x int8
    product in the form measured, the scales; models/quant.py): which form is faster depends on
    what runs around it (stop 51: at 32 rows the bare int8 products were faster weight-first,
    with their quantization slower)."""
    def run(weights, xs):
        s = jnp.zeros((), jnp.float32)
        for w in weights:
            x = xs[w.shape[1]] + (s * 0.0).astype(w.dtype)
            kind = "int8" if isinstance(w, QuantizedWeight) else jnp.dtype(w.dtype).name
            with lowering_forms({(kind, x.shape[0]): weight_first}):  # the served product, in this form
                s = proj(SPEC, x, w)[0, 0]
        return s

    return jax.jit(run)


def measure(weights: list, rows: int, repeats: int = REPEATS,
            compiler_options: dict | None = None) -> tuple[float, float]:
    """Median milliseconds of the chain of `weights` (float arrays, or int8 QuantizedWeights) at
    `rows` rows: (weight-first, plain), compiled with `compiler_options` (the buckets',
    engine/step/cpu_compile.py)."""
    xs = {i: jnp.full((rows, i), 0.01, weights[0].dtype) for i in sorted({w.shape[1] for w in weights})}
    calls = [_chain(form).lower(weights, xs).compile(compiler_options) for form in (True, False)]
    times: list[list[float]] = [[], []]
    for call in calls:
        call(weights, xs).block_until_ready()  # XLA:CPU's first run of an executable costs more
    for _ in range(repeats):
        for form, call in enumerate(calls):
            start = time.perf_counter()
            call(weights, xs).block_until_ready()
            times[form].append((time.perf_counter() - start) * 1e3)
    return float(np.median(times[0])), float(np.median(times[1]))


@functools.cache
def _machine() -> str:
    """What a measurement depends on besides the model: the CPU, jax and XLA's flags."""
    return "|".join([cpuinfo("model name"), str(os.cpu_count()), jax.__version__, os.environ.get("XLA_FLAGS", "")])


def _key(weights: list, rows: int, compiler_options: dict | None = None) -> str:
    shapes = [(jnp.dtype(w.dtype).name, *w.shape, *(["int8"] if isinstance(w, QuantizedWeight) else []))
              for w in weights]
    options = sorted((compiler_options or {}).items())
    text = json.dumps([_machine(), shapes, rows, *([options] if options else [])])  # (keys made before options stay)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        logger.warning("jaxserve: ignoring unreadable product form measurements %s", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: str | None, entries: dict) -> None:
    if not path or not entries:
        return
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        data = {**_read(path), **entries}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".product_forms")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # whole or not at all, also beside another process
    except OSError as e:
        logger.warning("jaxserve: could not keep product form measurements in %s: %s", path, e)


def measurements_path(compilation_cache_dir: str | None) -> str | None:
    """product_forms.json beside the compilation cache folder in use (None, no cache: kept in this
    process only)."""
    if not compilation_cache_dir:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(compilation_cache_dir)), "product_forms.json")


def resolve(form: str, params: dict, rows, *, path: str | None = None, min_bytes: int = MEASURE_MIN_BYTES,
            budget_seconds: float = BUDGET_SECONDS, compiler_options=None) -> dict | None:
    """The table models/weight_first.product_forms lowers a CPU engine's buckets with: {(dtype
    name, rows): weight-first?} for `rows` (the buckets' token and logit row counts), or None for
    the static rule. `form`: EngineConfig.cpu_product_form (module docstring); compiler_options:
    rows -> the buckets' compile options (the chains are measured compiled as they will be)."""
    if form not in CPU_PRODUCT_FORMS:
        raise ValueError(f"cpu_product_form must be one of {', '.join(CPU_PRODUCT_FORMS)}; got {form!r}")
    weights = product_weights(params)
    counts = sorted({int(r) for r in rows if int(r) >= 2})
    if form == "static":
        return None
    table = {}
    if weights:
        dtype = jnp.dtype(weights[0].dtype).name
        weights = [w for w in weights if jnp.dtype(w.dtype).name == dtype]
        if form in ("weight_first", "plain"):
            return {(dtype, r): form == "weight_first" for r in counts}
        table.update(_measured(weights, dtype, counts, path, min_bytes, budget_seconds, compiler_options))
    quantized = int8_weights(params) if form == "measured" else []
    if quantized:  # int8 x int8 products: the rows that quantize their activations
        counts = [r for r in counts if quantized[0].quantizes_activations(r)]
        table.update(_measured(quantized, "int8", counts, path, min_bytes, budget_seconds, compiler_options))
    return table or None


def _measured(weights, dtype, counts, path, min_bytes, budget_seconds, compiler_options) -> dict:
    """{(dtype, rows): weight-first?} for `counts` up to MEASURE_MAX_ROWS, each read from the
    measurements kept (this process's, then `path`'s) or timed now and kept; {} for weights under
    `min_bytes`."""
    size = lambda w: w.q.size if isinstance(w, QuantizedWeight) else w.size * w.dtype.itemsize  # noqa: E731
    if sum(size(w) for w in weights) < min_bytes:
        return {}
    stored, new, table, start, report = _read(path), {}, {}, time.perf_counter(), []
    for r in (r for r in counts if r <= MEASURE_MAX_ROWS):
        options = compiler_options and compiler_options(r)
        key = _key(weights, r, options)
        entry = _SEEN.get(key) or stored.get(key)
        if entry is None:
            if time.perf_counter() - start > budget_seconds:
                logger.info("jaxserve: product form budget (%.0f s) spent: %d rows keep the static rule",
                            budget_seconds, r)
                continue
            ms_first, ms_plain = measure(weights, r, compiler_options=options)
            entry = new[key] = {"rows": r, "dtype": dtype, "weight_first_ms": round(ms_first, 3),
                                "plain_ms": round(ms_plain, 3), "weight_first": ms_first < ms_plain}
        _SEEN[key] = entry
        table[(dtype, r)] = weight_first = bool(entry["weight_first"])
        rule = dtype != "int8" and static_rule(jnp.dtype(dtype), r)
        report.append(f"{r} rows {'weight-first' if weight_first else 'plain'} ({entry['weight_first_ms']:.1f} "
                      f"against {entry['plain_ms']:.1f} ms; static rule: {'weight-first' if rule else 'plain'})")
    _write(path, new)
    if table:
        logger.info("jaxserve: CPU product forms, %s, %s: %s", dtype,
                    f"measured in {time.perf_counter() - start:.1f} s" if new else "as measured before",
                    "; ".join(report))
    return table
