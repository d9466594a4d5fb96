"""The soak's progress check (experiments/bench/soak.py): did every request move at the pace of
requests of its own size, or did one starve while the rest finished?

1. Each request that finished is a `Sample`: its latency and its size (prompt tokens, tokens
   generated per sample, n, and whether its prompt was scored: echo with logprobs, or
   prompt_logprobs).
2. Its class is (prompt tokens' power-of-two bucket, generated tokens' bucket, n, scored). A
   class with fewer than `min_class_size` members is judged by the next coarser one that has
   enough: (generated bucket, n, scored), then (scored,), then the whole run.
3. Its ratio is latency / max(median latency of that class, floor x the run's median latency,
   min_seconds). The floors are there because under load every request also waits for a seat
   and for the steps of others: a class of tiny requests has a median far below that wait, and
   an ordinary wait (or one slow step on a busy machine) would look like starvation.
4. The run fails when a ratio exceeds `max_ratio`; the report names the worst request, its
   class and the median it was held to. (A request stuck past the client's timeout never
   finishes; the soak counts those separately, as stuck.)
"""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Sample:
    latency: float  # seconds from sending the request to its last byte
    prompt_tokens: int  # per prompt (usage.prompt_tokens / number of prompts)
    generated_tokens: int  # per sample (usage.completion_tokens / choices)
    n: int = 1  # samples per prompt
    scored: bool = False  # its prompt was scored (echo + logprobs, or prompt_logprobs)
    label: str = ""  # what the request was, for the report


@dataclasses.dataclass
class ProgressReport:
    max_ratio: float
    num_checked: int
    worst_ratio: float | None  # None when there was nothing to check
    worst: Sample | None
    worst_class: str  # the class the worst request was held to, in words
    worst_median: float | None  # that class's median latency (before the floor)
    num_over: int  # requests over max_ratio
    top: list[tuple[float, str]]  # the five highest ratios and their requests
    worst_by_label: dict[str, float] = dataclasses.field(default_factory=dict)  # the highest ratio per label

    @property
    def passed(self) -> bool:
        return self.num_over == 0

    def summary(self) -> str:
        if self.worst is None:
            return "progress: nothing to check"
        w = self.worst
        return (f"progress: {self.num_checked} requests, worst ratio {self.worst_ratio:.2f} (limit {self.max_ratio:g}): "
                f"{w.label or 'a request'} ({w.prompt_tokens} prompt tokens, {w.generated_tokens} generated, n={w.n}"
                f"{', scored' if w.scored else ''}) took {w.latency:.2f} s against a median of "
                f"{self.worst_median:.2f} s in {self.worst_class}; {self.num_over} over the limit")


def _bucket(tokens: int) -> int:
    """Power-of-two bucket: 0 for 0, then 1 for 1, 2 for 2-3, 3 for 4-7, ..."""
    return max(tokens, 0).bit_length()


def _keys(s: Sample) -> list[tuple]:
    """The sample's classes, finest first."""
    g = _bucket(s.generated_tokens)
    return [("prompt", _bucket(s.prompt_tokens), "generated", g, "n", s.n, "scored", s.scored),
            ("generated", g, "n", s.n, "scored", s.scored), ("scored", s.scored), ("all",)]


def _describe(key: tuple) -> str:
    if key == ("all",):
        return "the whole run"
    parts = []
    for name, value in zip(key[::2], key[1::2]):
        if name in ("prompt", "generated"):
            low, high = (0, 0) if value == 0 else (1 << (value - 1), (1 << value) - 1)
            parts.append(f"{name} tokens {low}-{high}")
        elif name == "n":
            parts.append(f"n={value}")
        else:
            parts.append("scored" if value else "not scored")
    return "the class " + ", ".join(parts)


def check_progress(samples: list[Sample], *, max_ratio: float = 8.0, min_class_size: int = 5,
                   floor: float = 0.5, min_seconds: float = 0.0) -> ProgressReport:
    """Each sample's latency against its class's median (the module docstring)."""
    if not max_ratio > 1:
        raise ValueError(f"check_progress: max_ratio must be > 1, got {max_ratio!r}")
    if not (isinstance(min_class_size, int) and min_class_size >= 1):
        raise ValueError(f"check_progress: min_class_size must be an integer >= 1, got {min_class_size!r}")
    if not 0 <= floor <= 1:
        raise ValueError(f"check_progress: floor must be in [0, 1], got {floor!r}")
    if not min_seconds >= 0:
        raise ValueError(f"check_progress: min_seconds must be >= 0, got {min_seconds!r}")
    for s in samples:
        if not (s.latency >= 0 and s.prompt_tokens >= 0 and s.generated_tokens >= 0 and s.n >= 1):
            raise ValueError(f"check_progress: a sample needs latency, prompt and generated tokens >= 0 and "
                             f"n >= 1, got {s}")
    if not samples:
        return ProgressReport(max_ratio, 0, None, None, "", None, 0, [])
    members: dict[tuple, list[float]] = {}
    for s in samples:
        for key in _keys(s):
            members.setdefault(key, []).append(s.latency)
    medians = {key: statistics.median(values) for key, values in members.items()}
    lowest = max(floor * medians[("all",)], min_seconds)
    rated = []
    for s in samples:
        key = next(k for k in _keys(s) if len(members[k]) >= min_class_size or k == ("all",))
        median = medians[key]
        denominator = max(median, lowest)
        ratio = s.latency / denominator if denominator > 0 else (0.0 if s.latency == 0 else float("inf"))
        rated.append((ratio, s, key, median))
    rated.sort(key=lambda r: r[0], reverse=True)
    by_label: dict[str, float] = {}
    for r in rated:  # highest first
        by_label.setdefault(r[1].label, round(r[0], 3))
    ratio, worst, key, median = rated[0]
    return ProgressReport(max_ratio, len(samples), ratio, worst, _describe(key), median,
                          sum(r[0] > max_ratio for r in rated), [(round(r[0], 2), r[1].label) for r in rated[:5]],
                          by_label)
