"""The seed's serving-idea experiments: one idea, arm against arm, in one process.

The engine ones drive an in-process LLMEngine (most through experiments/lab/engine_replay.py),
with the same compiled steps in every arm, so only the idea changes; paged_vs_contiguous runs
the scheduler alone. Each writes `<out_dir>/<name>.json`, `.md` and `.png` through
experiments/lab/report.py (out_dir experiments/results/ by default):

    python -m experiments.ideas.static_vs_continuous   # static against continuous batching
    python -m experiments.ideas.paged_vs_contiguous    # KV memory wasted, requests that fit
    python -m experiments.ideas.chunked_prefill        # users' inter-token latency under a long prompt
    python -m experiments.ideas.prefix_caching         # TTFT and prefill tokens on shared prompts
    python -m experiments.ideas.disaggregation         # prefill and decode on two pools (two processes)
    python -m experiments.ideas.speculative            # speculative decoding off / on / auto per load

They import experiments.lab and never each other or experiments.bench.
"""
