"""Benchmarks and checks: speed of one part, a load test of a server, or a numerical check.

    python -m experiments.bench.offline          # offline throughput (LLM.generate), two workloads
    python -m experiments.bench.serving          # load test of any OpenAI-compatible endpoint
    python -m experiments.bench.sweep            # throughput and tail latency against concurrency
    python -m experiments.bench.soak             # N requests, C clients, disconnects, bad requests
    python -m experiments.bench.kernel           # paged (xla) attention against dense attention
    python -m experiments.bench.layers           # the layer loops: compile time and step time
    python -m experiments.bench.scheduler        # schedule() + update() time per step
    python -m experiments.bench.structured       # the cost of structured output
    python -m experiments.bench.load             # GGUF dequantization against the orbax cache
    python -m experiments.bench.quant_forms      # int8 / fp8 product forms against float32, per row count
    python -m experiments.bench.q4_forms         # GGUF Q4 product forms against float32 and int8
    python -m experiments.bench.cold_start       # server launch to a healthy /health
    python -m experiments.bench.profile_step     # where a step's wall time goes, per bucket
    python -m experiments.bench.bf16_agreement   # bfloat16 greedy against the float32 reference
    python -m experiments.bench.tp_pallas_check  # the Pallas kernels under tensor parallelism

Result files keep their names under experiments/results/ (bench.json, bench_offline.json,
bench_layers.json, structured_output.json, ...). They import experiments.lab (and sweep and
profile_step their neighbours serving and offline), never experiments.ideas.
"""
