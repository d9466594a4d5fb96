"""Where a step's device time goes by op class: a `jax.profiler` trace of the engine's steps,
each XLA op the trace records classified from the compiled step's own HLO.

    with OpProfile(engine) as prof:
        ...run requests...
    print(prof.table())

XLA:CPU records one trace event per executed op (its thunks: a fusion, a library product
("ynn_fusion"), a copy, a while loop...), with the module and op name in its arguments. Each op's
own time is its duration minus the ops nested inside it (a while loop's body, for one), summed
over the traced steps. Each execution (the trace's run_id) is matched to the compiled bucket
whose HLO holds the op names it ran (`ModelRunner._compiled`; Executable.as_text(): every bucket's
module has the same name), and each op is classified two ways from that HLO:
  kind    what it computes: "product" (a dot or convolution, fused or a library call),
          "gather", "scatter" (scatter, dynamic-update-slice), "reduce", "copy/transpose",
          "elementwise" (every other fusion), "control" (while, conditional, call: their own
          time, i.e. loop overhead), or the opcode.
  where   the source file of the op's innermost stack frame (the HLO keeps jax's stack frames):
          "attention" (pallas_kernels/ xla paths), "kv write" (pallas_kernels/kv_write.py,
          kv_quant.py, tpu_kv_write.py), "weights" (the products of models/quant.py, int8_dot.py,
          weight_first.py and layers.py), "model" (other models/ code), "sampler" (engine/step/), or "other".
The numbers are a trace's (the profiler costs a few percent). On the CPU, ops of one step can run
at once on the thread pool and some time falls between ops, so the summed op time was 0.7-1.0x
the step's device time in the runs of BUILD_NOTES.md ("CPU attention forms"): read the shares.
The trace files stay in `trace_dir` (a temporary directory unless given).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^()]*\)|\S+)\s+([\w\-]+)\(")  # name = type op(
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation|branch_computations)="
                    r"\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CONTROL = {"while", "conditional", "call"}
PRODUCT_OPS = {"dot", "convolution"}
WHERE = (("pallas_kernels/kv_write", "kv write"), ("pallas_kernels/kv_quant", "kv write"),
         ("pallas_kernels/tpu_kv_write", "kv write"), ("pallas_kernels/", "attention"),
         ("models/quant", "weights"), ("models/int8_dot", "weights"), ("models/weight_first", "weights"),
         ("models/layers", "weights"), ("models/", "model"), ("engine/step/", "sampler"))


class HloIndex:
    """One module's ops: name -> (kind, where)."""

    def __init__(self, text: str):
        self.computations: dict[str, list[tuple[str, str, list[str], int | None]]] = {}
        files, locations, frames = {}, {}, {}
        section, current = None, None
        for line in text.splitlines():
            stripped = line.strip()
            if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = stripped
                continue
            if section and re.match(r"^\d+ ", stripped):
                key, rest = stripped.split(" ", 1)
                if section == "FileNames":
                    files[int(key)] = rest.strip('"')
                elif section == "FileLocations":
                    locations[int(key)] = int(re.search(r"file_name_id=(\d+)", rest).group(1))
                elif section == "StackFrames":
                    frames[int(key)] = int(re.search(r"file_location_id=(\d+)", rest).group(1))
                continue
            section = None if stripped == "" else section
            head = _COMPUTATION.match(line)
            if head and "=" not in line.split("{")[0].split("(")[0]:
                current = self.computations.setdefault(head.group(1), [])
                continue
            instr = _INSTR.match(line)
            if instr and current is not None:
                calls = [c.strip().lstrip("%") for m in _CALLS.finditer(line) for c in m.group(1).split(",")]
                frame = _FRAME_ID.search(line)
                current.append((instr.group(1), instr.group(2), calls, int(frame.group(1)) if frame else None))
        self._file_of_frame = {f: files.get(locations.get(loc), "") for f, loc in frames.items()}
        self.ops = {}
        for instrs in self.computations.values():
            for name, opcode, calls, frame in instrs:
                self.ops[name] = (self._kind(opcode, calls), self._where(opcode, calls, frame))

    def _opcodes(self, computation: str, seen=None) -> set[str]:
        seen = seen if seen is not None else set()
        if computation in seen:
            return set()
        seen.add(computation)
        out = set()
        for _, opcode, calls, _ in self.computations.get(computation, []):
            out.add(opcode)
            if opcode == "fusion":
                for c in calls:
                    out |= self._opcodes(c, seen)
        return out

    def _kind(self, opcode: str, calls: list[str]) -> str:
        if opcode in CONTROL:
            return "control"
        inner = {opcode} if opcode != "fusion" else set().union(*(self._opcodes(c) for c in calls))
        if inner & PRODUCT_OPS:
            return "product"
        for ops, kind in (({"gather", "dynamic-slice"}, "gather"), ({"scatter", "dynamic-update-slice"}, "scatter"),
                          ({"reduce", "reduce-window"}, "reduce")):
            if inner & ops:
                return kind
        if opcode in ("copy", "transpose") or (opcode == "fusion" and inner <= {
                "copy", "transpose", "parameter", "bitcast", "reshape", "tuple", "get-tuple-element"}):
            return "copy/transpose"
        return "elementwise" if opcode == "fusion" else opcode

    def _where(self, opcode: str, calls: list[str], frame: int | None) -> str:
        frames = [frame] if frame is not None else []
        if opcode == "fusion" and not frames:  # a fusion without metadata: its fused ops'
            frames = [f for c in calls for *_, f in self.computations.get(c, []) if f is not None]
        for f in frames:
            path = self._file_of_frame.get(f, "")
            for prefix, where in WHERE:
                if prefix in path:
                    return where
        return "other"


def _events(trace_dir: str):
    """The trace's complete events with an hlo_op (the XLA ops), newest trace file."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def self_times(events) -> dict[tuple[str, str], float]:
    """(module, op) -> summed own time in microseconds (nested ops on the same thread subtracted)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    total = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, key, child time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0] - 1e-6:
                end, key, child, dur = stack.pop()
                total[key] += dur - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], (e["args"].get("hlo_module", ""), e["args"]["hlo_op"]), 0.0, e["dur"]])
        for _, key, child, dur in stack:
            total[key] += dur - child
    return total


def _base(op: str, indexes) -> str:
    """The HLO name of a trace's op (the trace sometimes drops a ".N" suffix the HLO has, or
    adds one it has not)."""
    if any(op in index for index in indexes):
        return op
    return re.sub(r"\.\d+$", "", op)


class OpProfile:
    """A context manager tracing an engine's steps; `table()` the time by (where, kind)."""

    def __init__(self, engine, trace_dir: str | None = None):
        self.engine, self.trace_dir = engine, trace_dir or tempfile.mkdtemp(prefix="op_profile_")
        self.times: dict[tuple[str, str], float] = {}
        self.conflicting = 0.0  # microseconds of ops no bucket's HLO names

    def __enter__(self):
        import jax

        jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True)
        return self

    def __exit__(self, *exc):
        import jax

        jax.profiler.stop_trace()
        # Every bucket's module has the same name (the runner's step function) and the trace names
        # an op by module and op name only; each execution (the trace's run_id) is matched to the
        # bucket whose HLO holds the most of the op names it ran, and classified by that HLO.
        # `conflicting`: the time of ops that no bucket's HLO names (classified "?").
        indexes, modules = [], set()
        for executable in self.engine.runner._compiled.values():
            text = executable.as_text()
            modules.add(re.search(r"HloModule\s+([\w.\-]+)", text).group(1))
            indexes.append(HloIndex(text).ops)
        runs = collections.defaultdict(list)
        for e in _events(self.trace_dir):
            runs[e["args"].get("run_id")].append(e)
        totals = collections.Counter()
        self.conflicting = 0.0
        for events in runs.values():
            times = self_times(events)
            names = {_base(op, indexes) for module, op in times if module in modules}
            ops = max(indexes, key=lambda index: (len(names & index.keys()), -len(index))) if names else {}
            for (module, op), us in times.items():
                if module not in modules:  # not a step (a table refill, the sampler's side programs...)
                    totals[("not a step", "-")] += us
                    continue
                cls = ops.get(_base(op, indexes))
                if cls is None:
                    self.conflicting += us
                    cls = ("?", "other")
                totals[cls[::-1]] += us
        self.times = dict(totals)
        return False

    def rows(self) -> list[dict]:
        total = sum(self.times.values()) or 1.0
        return [dict(where=w, kind=k, ms=us / 1e3, share=us / total)
                for (w, k), us in sorted(self.times.items(), key=lambda kv: -kv[1])]

    def table(self, min_share: float = 0.005) -> str:
        lines = ["| where | kind | ms | share |", "| --- | --- | --- | --- |"]
        rest = 0.0
        for r in self.rows():
            if r["share"] < min_share:
                rest += r["share"]
                continue
            lines.append(f"| {r['where']} | {r['kind']} | {r['ms']:.1f} | {100 * r['share']:.1f} % |")
        lines.append(f"| (ops under {100 * min_share:.1f} % each) | | | {100 * rest:.1f} % |")
        total = sum(self.times.values()) or 1.0
        lines.append(f"ops not found in the matched bucket's HLO: {100 * self.conflicting / total:.1f} % of the time")
        by_where = collections.Counter()
        for r in self.rows():
            by_where[r["where"]] += r["share"]
        lines.append("by where: " + ", ".join(f"{w} {100 * s:.1f} %" for w, s in by_where.most_common()))
        return "\n".join(lines)
