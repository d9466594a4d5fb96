"""The Llama-family decoder as pure functions of a parameter pytree.

Einsum axes: t tokens, s key positions (dense path), e hidden, h query heads, k KV heads,
g query heads per KV head (h = k * g), d head dim, f MLP width, v vocabulary.

Parameters (a plain dict pytree; models/served_layout.py has both layouts and the conversions):
    The loaders' layout (in-major): embed [v, e]; final_norm [e]; lm_head [e, v] (absent when
    embeddings are tied); layer: attn_norm [e], wq [e, h, d], wk [e, k, d], wv [e, k, d], (bq
    [h, d], bk [k, d], bv [k, d] with attention_bias), wo [h, d, e], mlp_norm [e], w_gate [e, f],
    w_up [e, f], w_down [f, e].
    The served layout (what the runner serves): every projection one two-dimensional, out-major
    weight ([out, in], as in Hugging Face checkpoints): qkv_proj [(h + 2k) * d, e] (q heads,
    then k, then v; bias bqkv [(h + 2k) * d]), o_proj [e, h * d], gate_up_proj [2 * f, e]
    (gate rows, then up rows), down_proj [e, f], output_proj [v, e] for an untied lm_head.
    XLA:CPU's dot library (YNNPACK) reads such a weight in place; the loaders' in-major weights
    and the multi-axis einsums it went through a transpose copy on every step (BUILD_NOTES.md,
    "Layers: scan or unrolled"). Every function here takes either layout.
    `layers` is a list with one such dict per layer, or one dict of the same names stacked on a
    leading layer axis [n, ...] (`stack_layers`), 16-bit weights then held as uint16 bits
    (`pack_layer_bits`, read back as the embedding's dtype).

Numerics: the residual stream, the norms, RoPE and softmax are float32 whatever the weights'
dtype; each projection casts its input to the weights' dtype and accumulates in float32
(`preferred_element_type`), so bfloat16 weights cost half the bytes and no precision in the
accumulation. q, k, v are rounded to the KV cache's dtype, as the cache stores them.

Two attention paths share every other piece of the model:
1. `forward_dense(params, config, token_ids)`: one sequence, causal attention over its own K/V,
   no cache. It is the oracle the paged path is tested against.
2. `forward_paged(params, config, kv_cache, batch)`: a ragged batch of prefill chunks and decodes
   flattened over tokens. The attention metadata is prepared once per step; each layer writes
   its new K/V at `slot_mapping` into its layer of the stacked cache and attends over the paged
   cache through `pallas_kernels.ragged_paged_attention`, in place. Returns logits only at
   `batch.logits_indices` (the sampled positions), since that is all a step samples from.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.served_layout import num_layers_of, unpack_layer
from pallas_kernels import prepare_attention_metadata, ragged_paged_attention, write_kv
from pallas_kernels.kv_write import as_bits, from_bits


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [d/2] with the model's RoPE scaling applied (float64 numpy)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    ramp = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(middle, ramp, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [t, n, d] by position (the rotate-half layout of HF checkpoints)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [t, d/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def _proj(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [t, ...] times a weight: x cast to the weight's dtype, accumulated and returned in f32."""
    x = x.astype(w.dtype)
    pad = x.shape[0] == 1 and w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"
    if pad:
        # XLA:CPU runs a one-row bfloat16 product through a slow path (tens of times slower
        # than two rows, BUILD_NOTES.md): a zero second row keeps it on the fast one.
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    out = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return out[:1] if pad else out


def _qkv(layer: dict, h: jax.Array, positions: jax.Array, inv_freq: jax.Array, config: ModelConfig,
         kv_dtype):
    """q [t, h, d], k, v [t, k, d] in kv_dtype, RoPE applied (in float32) to q and k."""
    if "qkv_proj" in layer:
        return _split_qkv(_proj("te,ne->tn", h, layer["qkv_proj"]), layer.get("bqkv"), positions, inv_freq,
                          config, kv_dtype)
    q = _proj("te,ehd->thd", h, layer["wq"])
    k = _proj("te,ekd->tkd", h, layer["wk"])
    v = _proj("te,ekd->tkd", h, layer["wv"])
    if "bq" in layer:
        q, k, v = (x + layer[b].astype(jnp.float32) for x, b in ((q, "bq"), (k, "bk"), (v, "bv")))
    return _rope_and_round(q, k, v, positions, inv_freq, kv_dtype)


def _split_qkv(qkv, bias, positions, inv_freq, config: ModelConfig, kv_dtype):
    """The fused product [t, (h + 2k) * d] (plus its bias) -> q, k, v as `_qkv` returns them."""
    if bias is not None:
        qkv = qkv + bias.astype(jnp.float32)
    qkv = qkv.reshape(qkv.shape[0], -1, config.head_dim)
    num_q = config.num_heads
    q, k, v = jnp.split(qkv, [num_q, num_q + config.num_kv_heads], axis=1)
    return _rope_and_round(q, k, v, positions, inv_freq, kv_dtype)


def _rope_and_round(q, k, v, positions, inv_freq, kv_dtype):
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q.astype(kv_dtype), k.astype(kv_dtype), v.astype(kv_dtype)


def _swiglu(gate_up: jax.Array) -> jax.Array:
    """The fused gate/up product [t, 2f] -> silu(gate) * up [t, f]."""
    gate, up = jnp.split(gate_up, 2, axis=1)
    return jax.nn.silu(gate) * up


def _mlp(layer: dict, h: jax.Array) -> jax.Array:
    if "gate_up_proj" in layer:
        return _proj("tf,ef->te", _swiglu(_proj("te,ne->tn", h, layer["gate_up_proj"])), layer["down_proj"])
    gate = _proj("te,ef->tf", h, layer["w_gate"])
    up = _proj("te,ef->tf", h, layer["w_up"])
    return _proj("tf,fe->te", jax.nn.silu(gate) * up, layer["w_down"])


def _attn_out(layer: dict, attn: jax.Array) -> jax.Array:
    if "o_proj" in layer:
        return _proj("tn,en->te", attn.reshape(attn.shape[0], -1), layer["o_proj"])
    return _proj("thd,hde->te", attn, layer["wo"])


def _logits(params: dict, h: jax.Array) -> jax.Array:
    if "output_proj" in params:
        return _proj("te,ve->tv", h, params["output_proj"])
    if "lm_head" in params:
        return _proj("te,ev->tv", h, params["lm_head"])
    return _proj("te,ve->tv", h, params["embed"])


def dense_causal_attention(q, k, v, sm_scale: float, sliding_window: int | None = None):
    """q [t, h, d], k/v [t, k, d] of one sequence; plain softmax attention, causal."""
    t, num_heads, d = q.shape
    groups = num_heads // k.shape[1]
    qg = q.reshape(t, k.shape[1], groups, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(t, num_heads, d).astype(q.dtype)


def embed_tokens(embed: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Rows of the embedding table as float32, gathered as bits: XLA:CPU would convert a whole
    16-bit table to float32 every step to gather from it."""
    return from_bits(as_bits(embed)[token_ids], embed.dtype).astype(jnp.float32)


def forward_dense(params: dict, config: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """Logits [t, v] (float32) for one sequence of token ids [t], no cache.

    Causal, so trailing padding never changes the logits of the positions before it: callers jit
    it at a few padded lengths (tests do). Stacked layers run as a lax.scan (fast to compile)."""
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    sm_scale = 1.0 / math.sqrt(config.head_dim)

    kv_dtype = params["embed"].dtype

    def layer_step(x, layer):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(layer, h, positions, inv_freq, config, kv_dtype)
        attn = dense_causal_attention(q, k, v, sm_scale, config.sliding_window)
        x = x + _attn_out(layer, attn)
        return x + _mlp(layer, rms_norm(x, layer["mlp_norm"], config.rms_norm_eps))

    x = embed_tokens(params["embed"], token_ids)
    if isinstance(params["layers"], list):
        for layer in params["layers"]:
            x = layer_step(x, layer)
    else:
        dtype = params["embed"].dtype
        x, _ = jax.lax.scan(lambda x, layer: (layer_step(x, unpack_layer(layer, dtype)), None), x,
                            params["layers"])
    return _logits(params, rms_norm(x, params["final_norm"], config.rms_norm_eps))


def forward_paged(
    params: dict,
    config: ModelConfig,
    kv_cache: tuple,
    batch,
    *,
    attention_backend: str = "xla",
    interpret: bool = False,
    tp_axis: str | None = None,
    scan_layers: bool = False,
    return_hidden: bool = False,
):
    """One step over a ragged batch; returns ((k_cache, v_cache), logits [L, v] float32).

    return_hidden: also return the final hidden state (the residual stream after the last layer,
    before the final norm; float32 [L, e]) at `logits_indices`, as a third value (a draft head
    reads it: engine/spec_decode/draft_head.py).

    tp_axis: inside a shard_map over that mesh axis (models/sharding.py), `params`, `kv_cache`
    and `config` are one shard's (its heads, MLP columns and vocabulary rows); the residual
    stream is all-reduced after wo and after w_down (Megatron), the embedding lookup is
    vocab-parallel (a masked local gather, all-reduced) and the logits are all-gathered.

    `kv_cache` is (k_cache, v_cache), each [num_layers, num_blocks, block_size, k, d]
    (engine/step/kv_cache.py), in the model dtype or, for a 16-bit model on the xla path, uint16
    holding its bits (pallas_kernels/kv_write.py). `batch` has the StepInputs fields: input_ids [T], positions [T],
    slot_mapping [T], query_start_loc [S+1], seq_lens [S], block_tables [S, max_blocks_per_seq],
    num_seqs [], logits_indices [L] (see engine/step/step_inputs.py).

    Layers: a stacked `params["layers"]` runs as a lax.scan over the stacked weights with the
    cache in the carry. A list runs as a lax.scan over the layer index with `scan_layers`, whose
    body picks each layer's weight products with lax.switch (`_switch_scan`: every layer keeps
    its own buffers, read in place), and is unrolled without it. Both scans compile one layer
    whatever the depth; XLA:CPU copies a stacked layer's slice out before every dot, so the
    engine scans a list on the CPU (engine/config.py STACK_LAYER_WEIGHTS).
    """
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    sm_scale = 1.0 / math.sqrt(config.head_dim)
    num_tokens = batch.input_ids.shape[0]
    md = prepare_attention_metadata(
        batch.seq_lens, batch.block_tables, batch.query_start_loc, batch.num_seqs,
        num_tokens=num_tokens, num_q_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        block_size=kv_cache[0].shape[2], backend=attention_backend,
        sliding_window=config.sliding_window, head_dim=config.head_dim)

    kv_dtype = kv_cache[0].dtype if kv_cache[0].dtype != jnp.uint16 else params["embed"].dtype

    eps = config.rms_norm_eps
    reduce = (lambda y: y) if tp_axis is None else (lambda y: jax.lax.psum(y, tp_axis))

    def attention(q, k, v, k_cache, v_cache, index):  # no weights: compiled once under a scan
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, batch.slot_mapping, layer=index,
                                    backend=attention_backend, interpret=interpret)
        attn = ragged_paged_attention(
            q, k_cache, v_cache, md, layer=index, sm_scale=sm_scale,
            sliding_window=config.sliding_window, backend=attention_backend, interpret=interpret)
        return attn, k_cache, v_cache

    def decoder_layer(x, k_cache, v_cache, norms, qkv, out, mlp, index):
        """One layer, whatever holds its weights: qkv(h) -> q, k, v; out(attn); mlp(h)."""
        q, k, v = qkv(rms_norm(x, norms["attn_norm"], eps))
        attn, k_cache, v_cache = attention(q, k, v, k_cache, v_cache, index)
        x = x + reduce(out(attn))
        return x + reduce(mlp(rms_norm(x, norms["mlp_norm"], eps))), k_cache, v_cache

    def layer_step(x, k_cache, v_cache, layer, index):  # the layer's weights as a dict
        return decoder_layer(x, k_cache, v_cache, layer,
                             lambda h: _qkv(layer, h, batch.positions, inv_freq, config, kv_dtype),
                             functools.partial(_attn_out, layer), functools.partial(_mlp, layer), index)

    def switch_step(x, k_cache, v_cache, small, product, index):
        """A served-layout layer whose products are `product(name, x)` (a lax.switch) and whose
        norms and bias are the layer's rows of `small`."""
        return decoder_layer(
            x, k_cache, v_cache, small,
            lambda h: _split_qkv(product("qkv_proj", h), small.get("bqkv"), batch.positions, inv_freq, config,
                                 kv_dtype),
            lambda attn: product("o_proj", attn.reshape(attn.shape[0], -1)),
            lambda h: product("down_proj", _swiglu(product("gate_up_proj", h))), index)

    if tp_axis is None:
        x = embed_tokens(params["embed"], batch.input_ids)
    else:
        x = _embed_vocab_parallel(params["embed"], batch.input_ids, tp_axis)
    k_cache, v_cache = kv_cache
    layers = params["layers"]
    if isinstance(layers, list) and scan_layers:
        x, k_cache, v_cache = _switch_scan(x, k_cache, v_cache, layers, switch_step)
    elif isinstance(layers, list):
        for index, layer in enumerate(layers):
            x, k_cache, v_cache = layer_step(x, k_cache, v_cache, layer, index)
    else:
        def body(carry, xs):
            layer, index = xs
            return layer_step(*carry, unpack_layer(layer, params["embed"].dtype), index), None

        indices = jnp.arange(num_layers_of(params), dtype=jnp.int32)
        (x, k_cache, v_cache), _ = jax.lax.scan(body, (x, k_cache, v_cache), (layers, indices))
    hidden = x[batch.logits_indices]
    logits = _logits(params, rms_norm(hidden, params["final_norm"], config.rms_norm_eps))
    if tp_axis is not None:
        logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)
    if return_hidden:
        return (k_cache, v_cache), logits, hidden
    return (k_cache, v_cache), logits


# The served layout's products, as the lax.switch branches of `_switch_scan` run them.
SERVED_PRODUCTS = {"qkv_proj": "te,ne->tn", "o_proj": "tn,en->te", "gate_up_proj": "te,ne->tn",
                   "down_proj": "tf,ef->te"}


def _switch_scan(x, k_cache, v_cache, layers: list, switch_step):
    """The layers as a lax.scan over the layer index, each layer's weights in its own buffers.

    Each weight product is a lax.switch over one branch per layer holding that product alone,
    so every branch reads its layer's matrix in place (a scan over stacked weights slices each
    layer's out, a copy XLA:CPU makes before every dot) and the branches are library calls,
    cheap to compile; the norms, RoPE, attention, cache writes and activations are in the body,
    compiled once, with the layer's norm weights and bias (small) stacked and indexed. The
    tensor-parallel all-reduces stay outside the branches. Served layout only."""
    if any(name not in layers[0] for name in SERVED_PRODUCTS):
        raise ValueError("the switch layer scan runs the served layout (models/served_layout.py "
                         f"fuse_projections); got layer weights {sorted(layers[0])}")
    branches = {name: [functools.partial(_proj, spec, w=layer[name]) for layer in layers]
                for name, spec in SERVED_PRODUCTS.items()}
    small = {name: jnp.stack([layer[name] for layer in layers])
             for name in layers[0] if name not in SERVED_PRODUCTS}

    def body(carry, index):
        product = lambda name, h: jax.lax.switch(index, branches[name], h)  # noqa: E731
        rows = {name: a[index] for name, a in small.items()}
        return switch_step(*carry, rows, product, index), None

    indices = jnp.arange(len(layers), dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(body, (x, k_cache, v_cache), indices)
    return x, k_cache, v_cache


def _embed_vocab_parallel(embed: jax.Array, token_ids: jax.Array, axis: str) -> jax.Array:
    """This shard holds vocabulary rows [i * v_local, (i + 1) * v_local): its rows of the lookup,
    zeros elsewhere, summed over the shards (exact: one shard contributes each token)."""
    local = token_ids - jax.lax.axis_index(axis) * embed.shape[0]
    mine = (local >= 0) & (local < embed.shape[0])
    rows = embed_tokens(embed, jnp.where(mine, local, 0))
    return jax.lax.psum(jnp.where(mine[:, None], rows, 0.0), axis)
