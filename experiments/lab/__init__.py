"""The lab's shared parts: what the experiments and benchmarks import, not entry points.

- datasets.py: workloads (ShareGPT, traces, random, shared prefix) as SampleRequests;
- load_client.py: the async load generator for an OpenAI-compatible endpoint;
- metrics.py: serving metrics over per-request records, as vLLM's bench defines them;
- engine_replay.py: a workload replayed against an in-process LLMEngine, measured the same way;
- report.py: summaries, tables, figures and the result files every entry point writes;
- step_profiler.py: where a step's wall time goes, per bucket;
- capacity_devices.py, capacity_report.py, device_probe.py: the capacity calculator's device
  figures, its result and renderings, and a few-second device probe (experiments/capacity.py);
- reference_fixture.py: the default model's transformers reference (fixture prompts, greedy
  continuations, margins) and a padded dense forward over it (bf16_agreement, quant_quality);
- speculative_summary.py: experiments/ideas/speculative.py's tables and plot;
- tp_report.py: bytes per device and the collectives of a step per TP size, a report that times
  nothing; the one module here with flags (`python -m experiments.lab.tp_report --model=default
  --tp=1,2,4`).

Nothing here imports experiments.ideas, experiments.bench or the tools at experiments/'s top.
"""
