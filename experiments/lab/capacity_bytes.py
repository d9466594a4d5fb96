"""Bytes per weight for the capacity calculator (experiments/capacity.py), by the model dtype and
the weight quantization; its bytes per KV token are models/kv_bytes.py's.

- Weights, float: parameters x the dtype's size (`ModelConfig.num_params`).
- Weights, `quantization` "int8" | "fp8" (models/quant.py): every quantized matrix is 1 byte per
  value plus one float32 scale per output row; the quantized matrices are the served layout's
  qkv_proj [d (H + 2 K), e], o_proj [e, d H], gate_up_proj [2 f, e], down_proj [e, f] (for MoE
  the experts' [E 2 f_e, e] and [E e, f_e], a scale per expert and row) per layer, and with int8
  the tables (models/weight_formats.py QUANTIZED_TABLES): the embedding [V, e] (per vocabulary row) and an
  untied output_proj [V, e]; fp8 keeps the tables in the model dtype. The rest (norms, the MoE
  router) stays in the model dtype.
- KV per token (models/kv_bytes.py kv_bytes_per_token, the rule that sizes the engine's pool,
  engine/step/kv_cache.py): 2 x layers x KV heads x head_dim x the dtype's size; an 8-bit cache
  ("int8", "fp8_e4m3", pallas_kernels/kv_quant.py) stores head_dim bytes plus one bfloat16 scale
  per token and KV head. Neither module imports jax.
"""

from __future__ import annotations

from models import weight_formats
from models.config import ModelConfig

QUANTIZATIONS = (None, *weight_formats.QUANTIZATIONS)


def _check(quantization) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, int8 or fp8; got {quantization!r}")


def _tables_quantized(quantization: str) -> bool:
    """Whether the method quantizes the tables (models/weight_formats.py QUANTIZED_TABLES)."""
    return bool(weight_formats.QUANTIZED_TABLES[quantization])


def quantized_matrices(config: ModelConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(rows, cols) of the matrices quantization converts: one layer's, then the tables'."""
    e, d = config.hidden_size, config.head_dim
    layer = [(d * (config.num_heads + 2 * config.num_kv_heads), e), (e, d * config.num_heads)]
    if config.num_experts:
        n, f = config.num_experts, config.expert_size
        layer += [(n * 2 * f, e), (n * e, f)]
    else:
        layer += [(2 * config.intermediate_size, e), (e, config.intermediate_size)]
    tables = [(config.vocab_size, e)] * (1 if config.tie_word_embeddings else 2)
    return layer, tables


def _quantized_bytes(matrices) -> tuple[int, int]:
    """(float parameters they replace, their bytes quantized)."""
    params = sum(r * c for r, c in matrices)
    return params, params + weight_formats.SCALE_BYTES * sum(r for r, _ in matrices)


def weight_bytes(config: ModelConfig, itemsize: int, quantization: str | None = None) -> int:
    """All weight bytes (every device together)."""
    _check(quantization)
    if quantization is None:
        return config.num_params * itemsize
    layer, tables = quantized_matrices(config)
    layer_params, layer_bytes = _quantized_bytes(layer)
    table_params, table_bytes = _quantized_bytes(tables) if _tables_quantized(quantization) else (0, 0)
    rest = config.num_params - config.num_layers * layer_params - table_params
    return config.num_layers * layer_bytes + table_bytes + rest * itemsize


def untied_embedding_bytes(config: ModelConfig, itemsize: int, quantization: str | None = None) -> int:
    """Bytes of an untied input embedding (0 when tied): of it a decode step gathers only the
    batch's rows, so it is not streamed."""
    _check(quantization)
    if config.tie_word_embeddings:
        return 0
    rows, cols = config.vocab_size, config.hidden_size
    if quantization is None or not _tables_quantized(quantization):
        return rows * cols * itemsize
    return _quantized_bytes([(rows, cols)])[1]

