"""StepProfiler: where a step's wall time goes, per bucket (used by experiments.bench.profile_step and
experiments.bench.offline --profile).

Phases: schedule, input build, host-to-device, device compute, device-to-host, reading the result,
scheduler update, and the engine's detokenize/outputs. `attach(engine)` times the scheduler's
schedule() and update() and the whole LLMEngine.step(); the runner reports its own phases
(ModelRunner.profile): while profiling it waits for the transfer and for the compute separately,
so "device" is the compiled step alone. Per bucket (T tokens, S sequences, L logit rows): medians
in ms over the steps of that bucket; "host share" = 1 - device time / step time, summed over the
bucket's steps (everything the device does not do: Python, numpy, the detokenizer).
"""

from __future__ import annotations

import collections
import statistics
import time

PHASES = ("schedule", "build", "h2d", "device", "d2h", "read", "update", "outputs")


class StepProfiler:
    """Per-bucket phase times of every step of an engine it is attached to."""

    def __init__(self):
        self.steps: dict[object, list[dict]] = collections.defaultdict(list)
        self._current: dict | None = None

    def record_runner(self, bucket, **phases) -> None:  # called by ModelRunner.execute
        if self._current is not None:
            self._current.update(phases)
            self._current["bucket"] = bucket

    def attach(self, engine) -> StepProfiler:
        engine.runner.profile = self
        real_step = engine.step

        def step():
            self._wrap_scheduler(engine.scheduler)
            self._current = {}
            start = time.perf_counter()
            outputs = real_step()
            total = time.perf_counter() - start
            current, self._current = self._current, None
            if "bucket" in current:
                known = sum(current.get(p, 0.0) for p in PHASES if p != "outputs")
                current["outputs"] = total - known
                current["step"] = total
                self.steps[current.pop("bucket")].append(current)
            return outputs

        engine.step = step
        return self

    def _wrap_scheduler(self, scheduler) -> None:
        if getattr(scheduler, "_profiled", False):
            return
        for name, phase in (("schedule", "schedule"), ("update", "update")):
            real = getattr(scheduler, name)

            def timed(*args, _real=real, _phase=phase, **kwargs):
                start = time.perf_counter()
                result = _real(*args, **kwargs)
                if self._current is not None:
                    self._current[_phase] = self._current.get(_phase, 0.0) + time.perf_counter() - start
                return result

            setattr(scheduler, name, timed)
        scheduler._profiled = True

    def clear(self) -> None:
        self.steps.clear()

    def rows(self) -> list[dict]:
        """One row per bucket: step count, median ms per phase, the step's median, host share."""
        out = []
        for bucket, steps in sorted(self.steps.items(), key=lambda kv: kv[0].padded_tokens):
            med = {p: 1000 * statistics.median(s.get(p, 0.0) for s in steps) for p in PHASES}
            step_ms = 1000 * statistics.median(s["step"] for s in steps)
            device = sum(s["device"] for s in steps)
            total = sum(s["step"] for s in steps)
            out.append({"bucket": (bucket.padded_tokens, bucket.padded_seqs, bucket.padded_logits),
                        "steps": len(steps), **med, "step": step_ms, "host_share": 1 - device / total})
        return out

    def table(self) -> str:
        head = "| bucket (T, S, L) | steps | " + " | ".join(PHASES) + " | step ms | host share |"
        lines = [head, "|" + " --- |" * (len(PHASES) + 4)]
        for r in self.rows():
            cells = " | ".join(f"{r[p]:.2f}" for p in PHASES)
            lines.append(f"| {r['bucket']} | {r['steps']} | {cells} | {r['step']:.2f} | {r['host_share']:.1%} |")
        return "\n".join(lines)
