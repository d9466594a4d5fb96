"""experiments/ideas/speculative.py's results: one arm at one concurrency, the summary table with its
crossover and goals, and the plot. Kept apart from the experiment (which defines absl flags) so that
tests and notebooks import it beside the other experiments without a flag clash."""

from __future__ import annotations

import dataclasses

from experiments.lab import report


@dataclasses.dataclass
class ArmResult:
    arm: str
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    itl_p95_ms: float
    acceptance_rate: float
    mean_accepted_length: float
    num_switch_offs: int
    tokens_per_s_rounds: list[float] = dataclasses.field(default_factory=list)  # one per round


def median_of_rounds(rounds: list[ArmResult]) -> ArmResult:
    """One arm at one concurrency over several interleaved rounds: the median throughput and p95
    ITL, the totals summed, the acceptance counters of the first round (greedy: every round drafts
    and accepts the same tokens), the most switch-offs of any round, and each round's throughput."""
    first = rounds[0]
    return dataclasses.replace(
        first, num_requests=sum(r.num_requests for r in rounds), output_tokens=sum(r.output_tokens for r in rounds),
        seconds=sum(r.seconds for r in rounds), tokens_per_s=_median([r.tokens_per_s for r in rounds]),
        itl_p95_ms=_median([r.itl_p95_ms for r in rounds]),
        num_switch_offs=max(r.num_switch_offs for r in rounds),
        tokens_per_s_rounds=[round(r.tokens_per_s, 2) for r in rounds])


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def summarize(results: list[ArmResult], concurrencies: list[int]) -> tuple[dict, str]:
    """The table, each arm's ratio to off, the crossover (the first concurrency where always-on
    loses to off) and the automatic arm's goal (>= 0.95x the better of off and on at every c)."""
    by = {(r.arm, r.concurrency): r for r in results}
    rows, crossover, goals = [], None, []
    for r in results:
        off = by.get(("off", r.concurrency))
        ratio = r.tokens_per_s / off.tokens_per_s if off else float("nan")
        rows.append([r.concurrency, r.arm, r.tokens_per_s, f"{ratio:.2f}x", r.itl_p95_ms, r.acceptance_rate,
                     r.mean_accepted_length, r.num_switch_offs])
        if r.arm == "on" and off and ratio < 1 and crossover is None:
            crossover = r.concurrency
    for c in concurrencies:
        best = max((by[(a, c)].tokens_per_s for a in ("off", "on") if (a, c) in by), default=None)
        if best and ("auto", c) in by:
            goals.append(report.goal(f"c={c}: auto / best of off and on", by[("auto", c)].tokens_per_s / best, 0.95))
    text = report.markdown_table(["c", "arm", "tok/s", "vs off", "ITL p95 ms", "acceptance",
                                  "mean accepted len", "switch-offs"], rows)
    text += f"\ncrossover (first c where always-on loses to off): {crossover}\n"
    if goals:
        text += "\n" + report.goals_text(goals)
    return {"results": [dataclasses.asdict(r) for r in results], "crossover": crossover, "goals": goals}, text


def plot(results: list[ArmResult], title: str):
    fig, (ax_tput, ax_itl) = report.new_figure(2, width=5.5)
    for arm in dict.fromkeys(r.arm for r in results):
        mine = sorted((r for r in results if r.arm == arm), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in mine]
        ax_tput.plot(xs, [r.tokens_per_s for r in mine], marker="o", label=arm)
        ax_itl.plot(xs, [r.itl_p95_ms for r in mine], marker="o", label=arm)
    for ax, label in ((ax_tput, "output tokens/s"), (ax_itl, "p95 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_tput.set_title(title)
    return fig
