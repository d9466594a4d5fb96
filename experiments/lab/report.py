"""What every experiment entry point shares: summaries, tables, figures and the result files.

An experiment writes `<out_dir>/<name>.json` (its configuration, the command that ran it, each
arm's numbers, the goal and whether it was met), `<name>.md` (the table it printed) and
`<name>.png` (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from experiments.lab.metrics import BenchmarkMetrics, RequestRecord


def write_json(path: str | pathlib.Path, obj) -> None:
    """Indented JSON; non-finite floats become strings ("inf"), which strict JSON cannot hold.

    (experiments.bench.serving has its own writer, but importing it would define its absl flags here.)
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(obj), indent=1) + "\n")


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def command_line() -> str:
    """The command that is running, as `python -m experiments.<name> <flags>`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", *sys.argv[:1]]
    return " ".join(shlex.quote(a) for a in head + sys.argv[1:])


def environment() -> dict:
    import jax

    return {
        "platform": jax.devices()[0].platform,
        "device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def metrics_summary(m: BenchmarkMetrics) -> dict:
    """The headline numbers of one run (ms and per-second units), flat for tables and JSON."""
    return {
        "completed": m.completed,
        "failed": m.failed,
        "duration_s": m.duration_s,
        "output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "output_throughput": m.output_throughput,
        "ttft_ms_mean": m.ttft_ms.mean,
        "ttft_ms_p50": m.ttft_ms.median,
        "ttft_ms_p95": m.ttft_ms.p95,
        "tpot_ms_p50": m.tpot_ms.median,
        "itl_ms_p50": m.itl_ms.median,
        "itl_ms_p99": m.itl_ms.p99,
        "e2el_ms_p50": m.e2el_ms.median,
        "e2el_ms_p95": m.e2el_ms.p95,
    }


def percentiles_ms(values_s: Sequence[float]) -> dict:
    """p50 / p95 / p99 / max / mean in milliseconds (zeros for an empty set)."""
    if len(values_s) == 0:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p95, p99 = np.percentile(ms, (50, 95, 99))
    return {"n": int(ms.size), "mean": float(ms.mean()), "p50": float(p50), "p95": float(p95),
            "p99": float(p99), "max": float(ms.max())}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; inf when the denominator is 0 and the numerator is not."""
    if denominator == 0:
        return 0.0 if numerator == 0 else float("inf")
    return numerator / denominator


def goal(description: str, value: float, target: float, higher_is_better: bool = True) -> dict:
    met = value >= target if higher_is_better else value <= target
    return {"goal": description, "value": value, "target": target, "met": bool(met)}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def goals_text(goals: Sequence[Mapping]) -> str:
    return "".join(
        f"- {g['goal']}: {g['value']:.3g} (target {g['target']:g}) -> "
        f"{'met' if g['met'] else 'MISSED'}\n" for g in goals)


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def write_results(out_dir: str | pathlib.Path, name: str, summary: Mapping, text: str,
                  figure) -> dict[str, pathlib.Path]:
    """Writes `<name>.json`, `<name>.md` (the printed text) and `<name>.png`; closes the figure."""
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"{name}.{ext}" for ext in ("json", "md", "png")}
    write_json(paths["json"], dict(summary))
    paths["md"].write_text(f"# {name}\n\n`{summary.get('command', '')}`\n\n{text}")
    figure.tight_layout()
    figure.savefig(paths["png"], dpi=110)
    plt.close(figure)
    return paths


def short_records(records: Sequence[RequestRecord], output_lens: Sequence[int]) -> list[RequestRecord]:
    """The records of requests whose expected output is at most the median (the "short" ones)."""
    median = float(np.median(output_lens))
    return [r for r, n in zip(records, output_lens) if n <= median]
