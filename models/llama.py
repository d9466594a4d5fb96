"""The decoder every family runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Mixtral, Qwen3-MoE), as pure
functions of a parameter pytree. The families differ only by ModelConfig fields (models/config.py)
and by their config reader, tensor names and sharding table (models/families/); the shared layers
are models/layers.py and models/moe.py.

Einsum axes: t tokens, s key positions (dense path), e hidden, h query heads, k KV heads,
g query heads per KV head (h = k * g), d head dim, f MLP width, v vocabulary, E experts.

Parameters (a plain dict pytree; models/served_layout.py has both layouts and the conversions):
    The loaders' layout (in-major): embed [v, e]; final_norm [e]; lm_head [e, v] (absent when
    embeddings are tied); layer: attn_norm [e], wq [e, h, d], wk [e, k, d], wv [e, k, d], (bq
    [h, d], bk [k, d], bv [k, d] with attention_bias), wo [h, d, e], mlp_norm [e], w_gate [e, f],
    w_up [e, f], w_down [f, e]; with qk_norm q_norm [d], k_norm [d]; with sandwich_norms
    post_attn_norm [e], post_mlp_norm [e]; a mixture of experts has, instead of the MLP
    weights, router [E, e], experts_gate_up [E, 2f, e], experts_down [E, e, f] (out-major in
    both layouts, models/moe.py).
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

Per-layer attention kinds: a model mixing sliding-window and global layers (Gemma 2: alternating,
Gemma 3: five local to one global) has a layer period p (`ModelConfig.layer_period`); the layer
scans run groups of p layers, each position of the group with its static window, soft cap and
RoPE, so every attention backend gets a Python-int window and metadata cut for it (one metadata
per distinct window, prepared once per step). A depth p does not divide runs its last layers
after the scan.

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

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layer_loops import (
    Static,
    layer_index,
    rank_in_kind,
    served_product,
    switch_scan,
)
from models.layers import (  # noqa: F401  (apply_rope, rope_inv_freq, rms_norm: the public names)
    apply_rope,
    dense_causal_attention,
    embed_tokens,
    gated,
    proj,
    rms_norm,
    rope_inv_freq,
    soft_cap,
)
from models.moe import grouped_product, load_callback, moe_mlp
from models.served_layout import num_layers_of, unpack_layer
from pallas_kernels import prepare_attention_metadata, ragged_paged_attention, write_kv
from pallas_kernels.kv_quant import ScaledCache, fake_quantize_kv, rotate_heads
from pallas_kernels.validation import cache_sizes


class _Model:
    """The per-step constants of one model (RoPE tables, scales) and the layer built from them."""

    def __init__(self, config: ModelConfig, kv_dtype, reduce, tp_axis=None):
        self.config = config
        self.kv_dtype = kv_dtype
        self.reduce = reduce
        self.tp_axis = tp_axis
        self.kinds = config.layer_kinds
        self.period = config.layer_period
        self.inv_freq = {kind: jnp.asarray(rope_inv_freq(config, kind), jnp.float32)
                         for kind in set(self.kinds)}
        self.lora = None  # models/lora.LoRAStep when the step serves adapters
        self.num_tokens = None  # a serving step's real tokens (for models/moe.ExpertLoadRecorder)

    def norm(self, x, w):
        return rms_norm(x, w, self.config.rms_norm_eps, self.config.norm_offset)

    def finish_qkv(self, q, k, v, small, positions, kind):
        """q [t, h, d], k, v [t, k, d] (float32, bias added) -> q/k-normed, rotated, rounded."""
        if self.config.qk_norm:
            q, k = self.norm(q, small["q_norm"]), self.norm(k, small["k_norm"])
        inv_freq = self.inv_freq[kind]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return q.astype(self.kv_dtype), k.astype(self.kv_dtype), v.astype(self.kv_dtype)

    def split_qkv(self, qkv, bias):
        """The fused product [t, (h + 2k) * d] (plus its bias) -> q, k, v (float32)."""
        if bias is not None:
            qkv = qkv + bias.astype(jnp.float32)
        qkv = qkv.reshape(qkv.shape[0], -1, self.config.head_dim)
        num_q = self.config.num_heads
        return jnp.split(qkv, [num_q, num_q + self.config.num_kv_heads], axis=1)

    # ---- the weight products of one layer, whatever holds them -----------------------------

    def served_ops(self, product, small, index=None):
        """qkv(h), out(attn), mlp(h) from `product(name, *args)` over the served layout (with
        the step's LoRA deltas added to layer `index`'s products, models/lora.py)."""
        config = self.config
        if self.lora is not None:
            product = self.lora.wrap(product, layer_index(index))

        def qkv(h):
            return self.split_qkv(product("qkv_proj", h), small.get("bqkv"))

        def out(attn):
            return product("o_proj", attn.reshape(attn.shape[0], -1))

        def mlp(h):
            if not config.num_experts:
                return product("down_proj", gated(product("gate_up_proj", h), config.hidden_act))
            return self.moe(h, product("router", h), functools.partial(product, "experts_gate_up"),
                            functools.partial(product, "experts_down"), small, index)

        return qkv, out, mlp

    def loader_ops(self, layer, index=None, tap=None):
        """The same over the loaders' layout (separate in-major projections). tap(name, x) -> x,
        if given, sees the dense MLP's down-projection input ("down"; models/smoothing.py's
        calibration records its maxima)."""
        if "qkv_proj" in layer:
            return self.served_ops(lambda name, *a: served_product(name, *a, w=layer[name]), layer, index)
        if self.lora is not None:
            raise ValueError("LoRA adapters run on the served layout (models/served_layout.py)")
        config = self.config

        def qkv(h):
            q = proj("te,ehd->thd", h, layer["wq"])
            k = proj("te,ekd->tkd", h, layer["wk"])
            v = proj("te,ekd->tkd", h, layer["wv"])
            if "bq" in layer:
                q, k, v = (x + layer[b].astype(jnp.float32) for x, b in ((q, "bq"), (k, "bk"), (v, "bv")))
            return q, k, v

        def mlp(h):
            if config.num_experts:
                grouped = lambda name: lambda rows, gs: grouped_product(rows, layer[name], gs)  # noqa: E731
                return self.moe(h, proj("te,ne->tn", h, layer["router"]), grouped("experts_gate_up"),
                                grouped("experts_down"), layer, index)
            gate = proj("te,ef->tf", h, layer["w_gate"])
            up = proj("te,ef->tf", h, layer["w_up"])
            g = gated(jnp.concatenate([gate, up], -1), config.hidden_act)
            return proj("tf,fe->te", g if tap is None else tap("down", g), layer["w_down"])

        return qkv, lambda attn: proj("thd,hde->te", attn, layer["wo"]), mlp

    def moe(self, h, logits, gate_up, down, small, index):
        config = self.config
        record = load_callback(layer_index(index), self.num_tokens, config.num_experts, self.tp_axis is not None)
        num_local = small.get("experts_local", config.num_experts)
        if "experts_gate_up" in small:
            num_local = small["experts_gate_up"].shape[0]
        first = 0
        if num_local != config.num_experts:  # expert parallelism: this device's expert group
            devices_per_group = jax.lax.psum(1, self.tp_axis) // (config.num_experts // num_local)
            first = jax.lax.axis_index(self.tp_axis) // devices_per_group * num_local
        return moe_mlp(h, logits, gate_up, down, num_experts=config.num_experts,
                       k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                       act=config.hidden_act, first_expert=first, num_local_experts=num_local,
                       record=record)

    # ---- one layer --------------------------------------------------------------------------

    def layer(self, x, cache, small, ops, positions, kind, attend):
        """x [t, e] float32 -> x after one decoder layer; attend(q, k, v, cache, kind) -> (attn,
        cache) is the dense or the paged attention."""
        qkv, out, mlp = ops
        q, k, v = self.finish_qkv(*qkv(self.norm(x, small["attn_norm"])), small, positions, kind)
        attn, cache = attend(q, k, v, cache, kind)
        a = self.reduce(out(attn))
        if self.config.sandwich_norms:
            a = self.norm(a, small["post_attn_norm"])
        x = x + a
        m = self.reduce(mlp(self.norm(x, small["mlp_norm"])))
        if self.config.sandwich_norms:
            m = self.norm(m, small["post_mlp_norm"])
        return x + m, cache

    def logits(self, params, hidden):
        h = self.norm(hidden, params["final_norm"])
        if "output_proj" in params:
            out = proj("te,ve->tv", h, params["output_proj"])
        elif "lm_head" in params:
            out = proj("te,ev->tv", h, params["lm_head"])
        else:
            out = proj("te,ve->tv", h, params["embed"])
        return soft_cap(out, self.config.final_logit_softcap)

    def run_layers(self, x, cache, params, positions, attend, scan_layers):
        """Every layer over (x, cache), in the layout `params["layers"]` has (see forward_paged)."""
        layers = params["layers"]
        dtype = params["embed"].dtype
        p, n = self.period, num_layers_of(params)
        full = n - n % p  # layers the group scan covers

        def step(carry, small, ops, index):
            x, cache = carry
            return self.layer(x, cache, small, ops, positions, self.kinds[index % p],
                              functools.partial(attend, index=index))

        if isinstance(layers, list) and scan_layers:
            return switch_scan(x, cache, layers, p, lambda carry, small, product, index: step(
                carry, small, self.served_ops(product, small, index), index))
        if isinstance(layers, list):
            for index, layer in enumerate(layers):
                x, cache = step((x, cache), layer, self.loader_ops(layer, index), index)
            return x, cache

        def group_body(carry, g):  # p stacked layers from index g * p
            for j in range(p):
                index = g * p + j
                layer = unpack_layer({k: jax.tree.map(functools.partial(
                    jax.lax.dynamic_index_in_dim, index=index, keepdims=False), w)
                    for k, w in layers.items()}, dtype)
                carry = step(carry, layer, self.loader_ops(layer, Static(index, j)), Static(index, j))
            return carry, None

        carry = (x, cache)
        if full:
            carry, _ = jax.lax.scan(group_body, carry, jnp.arange(full // p, dtype=jnp.int32))
        for index in range(full, n):
            layer = unpack_layer({k: jax.tree.map(lambda a, i=index: a[i], w) for k, w in layers.items()}, dtype)
            carry = step(carry, layer, self.loader_ops(layer, index), index)
        return carry


def _unrotated(*xs):
    """kv_quant.rotate_heads's signature, rotating nothing (a float cache)."""
    return xs if len(xs) > 1 else xs[0]


def forward_dense(params: dict, config: ModelConfig, token_ids: jax.Array,
                  kv_cache_dtype: str = "auto") -> jax.Array:
    """Logits [t, v] (float32) for one sequence of token ids [t], no cache.

    Causal, so trailing padding never changes the logits of the positions before it: callers jit
    it at a few padded lengths (tests do). Stacked layers run as a lax.scan (fast to compile).
    kv_cache_dtype: attend over K and V as an 8-bit cache would give them back (int8, fp8_e4m3:
    pallas_kernels/kv_quant.py), in the rotated head basis forward_paged uses for such a cache
    (kv_quant.rotate_heads), the oracle of a paged step over that cache."""
    model = _Model(config, params["embed"].dtype, lambda y: y)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)

    rotate = _unrotated if kv_cache_dtype == "auto" else rotate_heads  # as forward_paged does

    def attend(q, k, v, cache, kind, index):
        q, k, v = rotate(q, k, v)
        k, v = fake_quantize_kv(k, kv_cache_dtype), fake_quantize_kv(v, kv_cache_dtype)
        return rotate(dense_causal_attention(q, k, v, config.sm_scale, config.window_of(kind),
                                             config.attn_logit_softcap)), cache

    x = embed_tokens(params["embed"], token_ids, config.embed_scale)
    x, _ = model.run_layers(x, (), params, positions, attend, scan_layers=False)
    return model.logits(params, x)


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
    lora_method: str = "masked",
    lora_rank: int | None = None,
    kv_layout: str = "token_major",
):
    """One step over a ragged batch; returns (kv_cache, logits [L, v] float32).

    return_hidden: also return the final hidden state (the residual stream after the last layer,
    before the final norm; float32 [L, e]) at `logits_indices`, as a third value (a draft head
    reads it: engine/spec_decode/draft_head.py).

    tp_axis: inside a shard_map over that mesh axis (models/sharding.py), `params`,
    `kv_cache` and `config` are one shard's (its heads, MLP columns and vocabulary rows); the
    residual stream is all-reduced after wo and after w_down (Megatron), the embedding lookup is
    vocab-parallel (a masked local gather, all-reduced) and the logits are all-gathered.
    Expert parallelism (models/sharding.py tp_layout with ep > 1): a device holding E / ep of
    the experts (its expert group's) runs only their grouped products, on its slice of their MLP
    width; the partial MoE output joins the same all-reduce over tp_axis as a dense MLP's.

    `kv_cache` is (k_cache, v_cache), each [num_layers, num_blocks, block_size, k, d]
    (engine/step/kv_cache.py; `kv_layout` "head_major", the engine's on the xla path:
    [num_layers, num_blocks, k, block_size, d], pallas_kernels/validation.KV_LAYOUTS), or for a model mixing windows with sliding-window accounting the
    two groups (k_global, v_global, k_sliding, v_sliding), the sliding layers' read through
    `batch.sliding_block_tables` and written at `batch.sliding_slot_mapping` (a model whose
    every layer slides has one group, read through the sliding tables by the runner's choice); in
    the model dtype or, for a 16-bit model on the xla path, uint16 holding its bits (pallas_kernels/kv_write.py), or an 8-bit cache, each a ScaledCache of values
    and per-(token, kv head) scales (pallas_kernels/kv_quant.py). `batch` has the StepInputs fields: input_ids [T], positions [T],
    slot_mapping [T], query_start_loc [S+1], seq_lens [S], block_tables [S, max_blocks_per_seq],
    num_seqs [], logits_indices [L] (see engine/step/step_inputs.py); with adapters in
    `params["lora"]` (models/lora.py) also lora_slots [T], computed by `lora_method` over the
    first `lora_rank` columns of each slot's rank (None: all; 0: no adapter products at all, for
    a step whose rows all run the base model).

    Layers: a stacked `params["layers"]` runs as a lax.scan over the stacked weights with the
    cache in the carry. A list runs as a lax.scan over the layer index with `scan_layers`, whose
    body picks each layer's weight products with lax.switch (`switch_scan`: every layer keeps
    its own buffers, read in place), and is unrolled without it. Both scans compile one layer
    group whatever the depth; XLA:CPU copies a stacked layer's slice out before every dot, so the
    engine scans a list on the CPU (engine/config.py STACK_LAYER_WEIGHTS).
    """
    num_tokens = batch.input_ids.shape[0]
    windows = {config.window_of(kind) for kind in config.layer_kinds}
    two_groups = len(kv_cache) == 4  # the global and the sliding layers' groups
    if two_groups and len(windows) != 2:
        raise ValueError(f"forward_paged: a two-group KV cache needs a model mixing sliding-window and "
                         f"global layers; {config.name!r} has windows {sorted(windows, key=str)}")
    # Each window's group: its block tables and slots (one group: every layer reads the same).
    tables = {w: batch.block_tables if w is None or not two_groups else batch.sliding_block_tables
              for w in windows}
    slots = {w: batch.slot_mapping if w is None or not two_groups else batch.sliding_slot_mapping
             for w in windows}
    md = {w: prepare_attention_metadata(
        batch.seq_lens, tables[w], batch.query_start_loc, batch.num_seqs,
        num_tokens=num_tokens, num_q_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        block_size=cache_sizes(kv_cache[0].shape, kv_layout).block_size, backend=attention_backend, sliding_window=w,
        head_dim=config.head_dim) for w in windows}

    # The dtype q, k, v are rounded to: the cache's, or the model's for a uint16 (bits) cache and
    # an 8-bit one (pallas_kernels/kv_quant.py: write_kv quantizes k and v per token and kv head).
    kv_dtype = kv_cache[0].dtype
    eight_bit = isinstance(kv_cache[0], ScaledCache)
    # An 8-bit cache holds K and V in a rotated head basis: q, k, v rotated, the output back.
    rotate = rotate_heads if eight_bit else _unrotated
    if kv_dtype == jnp.uint16 or eight_bit:
        kv_dtype = params["embed"].dtype
    reduce = (lambda y: y) if tp_axis is None else (lambda y: jax.lax.psum(y, tp_axis))
    model = _Model(config, kv_dtype, reduce, tp_axis)
    model.num_tokens = batch.query_start_loc[-1]  # padded rows repeat the end
    if "lora" in params and lora_rank != 0:  # adapters (models/lora.py): each token's slot, 0 = none
        from models.lora import LoRAStep

        model.lora = LoRAStep(params["lora"], batch.lora_slots, config, lora_method, lora_rank)

    def attend(q, k, v, cache, kind, index):  # no weights: compiled once per kind under a scan
        window = config.window_of(kind)
        group = 2 if two_groups and window is not None else 0  # its (k, v) pair in `cache`
        k_cache, v_cache = cache[group], cache[group + 1]
        index = rank_in_kind(config, index, kind) if two_groups else layer_index(index)
        q, k, v = rotate(q, k, v)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots[window], layer=index,
                                    backend=attention_backend, interpret=interpret, kv_layout=kv_layout)
        attn = ragged_paged_attention(
            q, k_cache, v_cache, md[window], layer=index, sm_scale=config.sm_scale,
            sliding_window=window, soft_cap=config.attn_logit_softcap, backend=attention_backend,
            interpret=interpret, kv_layout=kv_layout)
        return rotate(attn), (*cache[:group], k_cache, v_cache, *cache[group + 2:])

    if tp_axis is None:
        x = embed_tokens(params["embed"], batch.input_ids, config.embed_scale)
    else:
        x = _embed_vocab_parallel(params["embed"], batch.input_ids, tp_axis, config.embed_scale)
    x, kv_cache = model.run_layers(x, tuple(kv_cache), params, batch.positions, attend, scan_layers)
    hidden = x[batch.logits_indices]
    logits = model.logits(params, hidden)
    if tp_axis is not None:
        logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)
    if return_hidden:
        return kv_cache, logits, hidden
    return kv_cache, logits


def _embed_vocab_parallel(embed: jax.Array, token_ids: jax.Array, axis, scale: bool = False) -> jax.Array:
    """This shard holds vocabulary rows [i * v_local, (i + 1) * v_local): its rows of the lookup,
    zeros elsewhere, summed over the shards (exact: one shard contributes each token)."""
    local = token_ids - jax.lax.axis_index(axis) * embed.shape[0]
    mine = (local >= 0) & (local < embed.shape[0])
    rows = embed_tokens(embed, jnp.where(mine, local, 0), scale)
    return jax.lax.psum(jnp.where(mine[:, None], rows, 0.0), axis)
