"""The weight quantizations (EngineConfig.quantization's int8 / fp8) and what each stores, without
jax: models/quant.py quantizes by these, and the capacity calculator (experiments/lab/
capacity_bytes.py) counts their bytes from them without importing jax.

- QUANTIZATIONS: the methods quantize_params applies at load ("gguf" is a file's own blocks,
  models/gguf_blocks.py, not one of these).
- QUANTIZED_TABLES: the tables each method quantizes besides the layers' products. int8 takes
  the embedding (the lm_head of a tied model: 21 % of the default model) and an untied
  output_proj; fp8 keeps both in the model's dtype, as vLLM's fp8 does (models/quant.py, 1.).
- SCALE_BYTES: one float32 scale per output row of a quantized matrix.
"""

QUANTIZATIONS = ("int8", "fp8")
QUANTIZED_TABLES = {"int8": ("embed", "output_proj"), "fp8": ()}
SCALE_BYTES = 4
