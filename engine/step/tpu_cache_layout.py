"""How the TPU kernels lay the KV cache out, found before the pool is sized.

On the TPU the steps pin the cache's layout to the Mosaic kernels' (program.pins_cache_layout), and
that layout pads the cache's minor dims (kv heads, head_dim) to the kernels' tiles: the default
model's [.., 3, 64] sits in (4, 128) tiles, 2.67x its values' bytes (docs/tpu_gpu.md). A pool
sized by its values' bytes would then not fit its budget. `laid_out_factor` compiles the kernels
alone (one KV write and one attention call, the layout left to XLA, as the first bucket's compile
does) over a cache of the real per-device shape with a few blocks, and returns the laid-out bytes
over the plain ones; the engine's builder and experiments.aot divide the cache's budget by it.
It only compiles: on compile-only devices too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

from engine.step.kv_cache import allocate_kv_cache
from engine.step.program import cache_bytes
from models.config import ModelConfig
from pallas_kernels import prepare_attention_metadata, ragged_paged_attention, write_kv

PROBE_BLOCKS = 16  # blocks of the probe's cache: the tiles are the minor dims', not the pool's
PROBE_TOKENS, PROBE_SEQS = 8, 2


def _probe(q, k, v, slots, seq_lens, tables, starts, num_seqs, k_cache, v_cache, *, config: ModelConfig,
           block_size: int):
    md = prepare_attention_metadata(seq_lens, tables, starts, num_seqs, num_tokens=q.shape[0],
                                    num_q_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                    block_size=block_size, backend="pallas_tpu", head_dim=config.head_dim)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots, layer=0, backend="pallas_tpu")
    out = ragged_paged_attention(q, k_cache, v_cache, md, layer=0, sm_scale=1.0, backend="pallas_tpu")
    return out, k_cache, v_cache


def laid_out_factor(config: ModelConfig, *, block_size: int, dtype: str, kv_cache_dtype: str, device,
                    num_layers: int | None = None) -> float:
    """The TPU kernels' cache layout's bytes over the cache's plain bytes (values and scales) for
    one device's share (`config`: the per-device kv heads), `num_layers` layers (the model's by
    default: a one-layer stacked cache is laid out unlike a deeper one)."""
    layers = config.num_layers if num_layers is None else num_layers
    cache = jax.eval_shape(lambda: allocate_kv_cache(
        _with_layers(config, layers), PROBE_BLOCKS, block_size, dtype, kv_cache_dtype=kv_cache_dtype,
        scale_layout="page"))
    one = SingleDeviceSharding(device)
    auto = jax.tree.map(lambda _: Format(Layout.AUTO, one), cache)
    arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)  # noqa: E731
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    args = (arg((PROBE_TOKENS, hq, d), dtype), arg((PROBE_TOKENS, hkv, d), dtype), arg((PROBE_TOKENS, hkv, d), dtype),
            arg((PROBE_TOKENS,), np.int32), arg((PROBE_SEQS,), np.int32), arg((PROBE_SEQS, PROBE_BLOCKS), np.int32),
            arg((PROBE_SEQS + 1,), np.int32), arg((), np.int32))
    plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache)
    probe = jax.jit(functools.partial(_probe, config=config, block_size=block_size),
                    in_shardings=(*(None,) * len(args), *auto), out_shardings=(None, *auto),
                    donate_argnums=(len(args), len(args) + 1))
    compiled = probe.lower(*args, *plain).compile()
    laid, plain_bytes = cache_bytes(plain, compiled.input_formats[0][len(args):])
    return laid / plain_bytes


def _with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    if num_layers == config.num_layers:
        return config
    return dataclasses.replace(config, num_layers=num_layers,
                               layer_types=config.layer_types[:num_layers] if config.layer_types else None)
