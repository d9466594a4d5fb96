"""The lab: absl-flag entry points over the engine, the server and the models.

- ideas/: the seed's serving-idea experiments, arm against arm (`python -m experiments.ideas.X`);
- bench/: benchmarks and checks (`python -m experiments.bench.X`);
- lab/: the shared parts those two import (datasets, load client, metrics, reports, replay);
- here, the tools: `python -m experiments.capacity` (the capacity calculator),
  `python -m experiments.aot` (every bucket compiled for a TPU or GPU target from the CPU),
  `python -m experiments.generate` (one chat prompt) and `python -m experiments.train_draft`
  (the draft head for speculative decoding).

Arrows point one way: ideas, bench and the tools import lab; lab imports none of them; nothing
in experiments imports the tools (tests/test_layering.py checks it).
"""
