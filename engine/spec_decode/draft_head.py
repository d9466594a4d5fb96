"""The draft-head proposer: an EAGLE-style head, one small decoder layer over the target's own final
hidden state, drafts k tokens per row on the device (trained by `python -m experiments.train_draft`).

The head (per chain step j = 0 .. k-1, all rows at once):
    x_j = fc([rms_norm(f_j) ; embed(t_j)])                       concat -> linear [2e -> e]
    x_j = x_j + attention(rms_norm(x_j)) over chain steps 0..j   one Llama block: norm,
    x_j = x_j + mlp(rms_norm(x_j))                               GQA attention, SwiGLU MLP
    d_j = vocab_map[argmax(lm_draft(final_norm(x_j)))]           the target's final norm + lm_head
with f_0 the target's final hidden state (after its last layer, before its final norm) at the row's
last kept position and t_0 the token sampled there (the request's last token); then f_{j+1} = x_j
(the head's own hidden state) and t_{j+1} = d_j. The embedding and the final norm are the target's
arrays (shared, not copied). lm_draft is the target's lm_head (or tied embedding) restricted to
the `draft_vocab_size` tokens most frequent in the target's own greedy outputs (`vocab_map`, ranked
by frequency): on the CPU the full 49152 x 576 lm_head would cost about a fifth of a target step
per draft token, the truncated one (4096 rows) a twelfth of that. Drafts outside the map are never
proposed; every draft is verified by the target, so outputs stay exact whatever the head says.

Attention runs over the chain only (the head's own K/V of steps 0..j, RoPE at chain positions
0..j): no per-request KV cache for the head, nothing to roll back on rejection or preemption, and
training needs only (hidden state, token) pairs with the target's greedy continuation. The
request's past reaches the head through f_0, the target's summary of the whole context.

Per engine step: the target runner (ModelRunner(keep_hidden=True)) keeps each step's hidden rows on
the device (`runner.hidden`, float32 [max L, e]) and the row of each request's last kept token
(`runner.hidden_rows`). Before schedule(), `propose` gathers the chosen rows' hidden states and
last tokens inside one jitted function (compiled once per sequence bucket at start-up; rows padded
to the bucket; k fixed), and copies k draft ids per row to the host, with their confidence (the
product of the head's top-1 probabilities so far): a row's drafts stop before the first whose
confidence is under `draft_confidence_threshold`, so a step the head is unsure about verifies
fewer tokens (on the CPU a step's cost grows with its tokens). A request that did not sample in
the previous step (first decode after a preemption's recompute, say) gets no drafts that step.
Drafts are greedy point masses, verified by the normal coupled sampler (verify.py).

Saved head (a folder): `draft_head.json` (DraftHeadConfig and a training summary) and `params/`
(an orbax StandardCheckpointer tree {"params": ..., "vocab_map": int32[V']}).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import argmax
from models.llama import apply_rope, embed_tokens, rms_norm, rope_inv_freq

MARKER = "draft_head.json"


@dataclasses.dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int  # e: the target's hidden size
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the head's MLP width
    draft_vocab_size: int  # V': rows of lm_draft (the vocab_map's length)
    target_vocab_size: int  # ids of the target's embedding (checked at load)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target: str = ""  # the target model spec it was trained on (informational)
    num_speculative_tokens: int = 3  # the chain length it was trained for

    # RoPE over chain positions 0..k-1 only: never scaled (what models.llama.rope_inv_freq reads).
    rope_scaling = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "draft_vocab_size", "target_vocab_size", "num_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DraftHeadConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError("DraftHeadConfig: num_heads must be a multiple of num_kv_heads and head_dim even")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"DraftHeadConfig.draft_vocab_size ({self.draft_vocab_size}) exceeds the "
                             f"target's vocabulary ({self.target_vocab_size})")

    @classmethod
    def for_target(cls, config, *, draft_vocab_size: int, intermediate_size: int | None = None,
                   target: str = "", num_speculative_tokens: int = 3) -> DraftHeadConfig:
        """The head's shape for a target ModelConfig: its attention shape, its MLP width unless given."""
        return cls(hidden_size=config.hidden_size, num_heads=config.num_heads,
                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                   intermediate_size=intermediate_size or config.intermediate_size,
                   draft_vocab_size=min(draft_vocab_size, config.vocab_size),
                   target_vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                   rope_theta=config.rope_theta, target=target,
                   num_speculative_tokens=num_speculative_tokens)


def num_params(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def init_params(cfg: DraftHeadConfig, key: jax.Array, target_layer: dict | None = None) -> dict:
    """Random head weights (scaled normal). With `target_layer` (the target's last decoder layer,
    the loaders' separate q/k/v, gate/up layout) the block starts from its weights when the MLP
    width matches: a prior that helps when the training set is small."""
    e, h, kv, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    keys = jax.random.split(key, 8)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)

    # fc: the feature half starts as identity (the head first sees the target's own state), the
    # token half small and random.
    fc = jnp.concatenate([jnp.eye(e, dtype=jnp.float32), 0.1 * normal(keys[0], (e, e), e)])
    layer = {
        "attn_norm": jnp.ones((e,), jnp.float32),
        "wq": normal(keys[1], (e, h, d), e), "wk": normal(keys[2], (e, kv, d), e),
        "wv": normal(keys[3], (e, kv, d), e), "wo": normal(keys[4], (h, d, e), h * d) * 0.1,
        "mlp_norm": jnp.ones((e,), jnp.float32),
        "w_gate": normal(keys[5], (e, f), e), "w_up": normal(keys[6], (e, f), e),
        "w_down": normal(keys[7], (f, e), f) * 0.1,
    }
    if target_layer is not None:
        for name in layer:
            w = target_layer.get(name)
            if w is not None and tuple(w.shape) == tuple(layer[name].shape):
                layer[name] = jnp.asarray(w, jnp.float32)
    return {"feat_norm": jnp.ones((e,), jnp.float32), "fc": fc, "layer": layer}


def shared_from_target(target_params: dict, vocab_map) -> dict:
    """The target's arrays the head reads: its embedding and final norm (the same arrays), and
    lm_draft [e, V'], its lm_head (or tied embedding) at the vocab_map's ids, as float32."""
    ids = jnp.asarray(vocab_map, jnp.int32)
    if "output_proj" in target_params:  # the served layout's untied lm_head [v, e]
        lm = embed_tokens(target_params["output_proj"], ids).T
    elif "lm_head" in target_params:  # the loaders' untied lm_head [e, v]
        lm = jnp.take(target_params["lm_head"], ids, axis=1)
    else:  # tied: the embedding [v, e]
        lm = embed_tokens(target_params["embed"], ids).T
    return {"embed": target_params["embed"], "final_norm": target_params["final_norm"],
            "lm_draft": lm.astype(jnp.float32), "vocab_map": ids}


def _inv_freq(cfg: DraftHeadConfig) -> jax.Array:
    return jnp.asarray(rope_inv_freq(cfg), jnp.float32)


def draft_chain(params: dict, shared: dict, cfg: DraftHeadConfig, feature: jax.Array,
                tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """k chain steps for B rows. feature: float32 [B, e], the target's final hidden state at each
    row's last position; tokens: int32 [B, 1] (the token sampled there: the head feeds its own
    drafts after it) or [B, k] (teacher forcing: step j feeds tokens[:, j]; training).
    Returns (logits over the draft vocabulary [B, k, V'] float32, draft token ids int32 [B, k],
    the head's hidden states [B, k, e], which training compares with the target's)."""
    eps = cfg.rms_norm_eps
    layer = params["layer"]
    inv_freq = _inv_freq(cfg)
    batch = feature.shape[0]
    groups = cfg.num_heads // cfg.num_kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)
    keys, values, all_logits, drafts, features = [], [], [], [], []
    token = tokens[:, 0]
    for j in range(k):
        x = jnp.concatenate([rms_norm(feature, params["feat_norm"], eps),
                             embed_tokens(shared["embed"], token)], axis=-1) @ params["fc"]
        h = rms_norm(x, layer["attn_norm"], eps)
        pos = jnp.full((batch,), j, jnp.int32)
        q = apply_rope(jnp.einsum("be,ehd->bhd", h, layer["wq"]), pos, inv_freq)
        keys.append(apply_rope(jnp.einsum("be,ekd->bkd", h, layer["wk"]), pos, inv_freq))
        values.append(jnp.einsum("be,ekd->bkd", h, layer["wv"]))
        kk, vv = jnp.stack(keys, 1), jnp.stack(values, 1)  # [B, j + 1, kv, d]
        qg = q.reshape(batch, cfg.num_kv_heads, groups, cfg.head_dim)
        probs = jax.nn.softmax(jnp.einsum("bkgd,bskd->bkgs", qg, kk) * scale, axis=-1)
        attn = jnp.einsum("bkgs,bskd->bkgd", probs, vv).reshape(batch, cfg.num_heads, cfg.head_dim)
        x = x + jnp.einsum("bhd,hde->be", attn, layer["wo"])
        m = rms_norm(x, layer["mlp_norm"], eps)
        x = x + (jax.nn.silu(m @ layer["w_gate"]) * (m @ layer["w_up"])) @ layer["w_down"]
        logits = rms_norm(x, shared["final_norm"], eps).astype(jnp.float32) @ shared["lm_draft"]
        draft = shared["vocab_map"][argmax(logits)]
        all_logits.append(logits)
        drafts.append(draft)
        features.append(x)
        feature = x
        if j + 1 < k:
            token = tokens[:, j + 1] if tokens.shape[1] > 1 else draft
    return jnp.stack(all_logits, 1), jnp.stack(drafts, 1).astype(jnp.int32), jnp.stack(features, 1)


# ------------------------------------------------------------------------------- save / load


def save_head(folder: str | os.PathLike, cfg: DraftHeadConfig, params: dict, vocab_map,
              summary: dict | None = None) -> None:
    import orbax.checkpoint as ocp

    folder = os.path.abspath(os.fspath(folder))
    os.makedirs(folder, exist_ok=True)
    tree = {"params": jax.tree.map(np.asarray, params), "vocab_map": np.asarray(vocab_map, np.int32)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(folder, "params"), tree, force=True)
    checkpointer.wait_until_finished()
    tmp = os.path.join(folder, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "summary": summary or {}, "format": 1}, f, indent=1)
    os.replace(tmp, os.path.join(folder, MARKER))  # the marker appears only once params are whole


def load_head(folder: str | os.PathLike) -> tuple[DraftHeadConfig, dict, np.ndarray, dict]:
    """(config, params as float32 device arrays, vocab_map int32[V'], training summary). Errors
    name speculative_config.model, the key that names the folder."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    cfg = read_head_config(folder)
    with open(os.path.join(folder, MARKER)) as f:
        meta = json.load(f)
    try:
        tree = ocp.StandardCheckpointer().restore(os.path.join(folder, "params"))
    except Exception as e:
        raise ValueError(f"speculative_config.model={folder!r}: cannot restore params/ ({e})") from None
    vocab_map = np.asarray(tree["vocab_map"], np.int32)
    if vocab_map.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"speculative_config.model={folder!r}: vocab_map has shape {vocab_map.shape}, "
                         f"the config says {cfg.draft_vocab_size} ids")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree["params"])
    return cfg, params, vocab_map, meta.get("summary", {})


# ------------------------------------------------------------------------------- the proposer


def _propose(params, shared, hidden, rows, tokens, *, cfg: DraftHeadConfig, k: int):
    """Draft ids [S, k] and their confidence [S, k]: the running product of the head's top-1
    probabilities (over the draft vocabulary)."""
    logits, drafts, _ = draft_chain(params, shared, cfg, hidden[rows], tokens[:, None], k)
    top = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    return drafts, jnp.cumprod(top, axis=1)


def _propose_fn(cfg: DraftHeadConfig, k: int):
    return jax.jit(lambda p, s, hid, r, t: _propose(p, s, hid, r, t, cfg=cfg, k=k))


def draft_head_program(cfg: DraftHeadConfig, target_params: dict, k: int):
    """(the proposer's jitted chain, the head's weights, the target's arrays it reads) with the
    weights as ShapeDtypeStructs: compiling the head without its weights (experiments.aot).
    `target_params` may be abstract too."""
    head = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    vocab = jax.ShapeDtypeStruct((cfg.draft_vocab_size,), jnp.int32)
    shared = jax.eval_shape(shared_from_target, target_params, vocab)
    return _propose_fn(cfg, k), head, shared


def read_head_config(folder: str | os.PathLike) -> DraftHeadConfig:
    """The head's config alone (its draft_head.json), without restoring its weights."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return DraftHeadConfig(**json.load(f)["config"])
    except FileNotFoundError:
        raise ValueError(f"speculative_config.model={folder!r}: not a draft head folder (no {MARKER}; "
                         "train one with python -m experiments.train_draft)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"speculative_config.model={folder!r}: bad {MARKER} ({e})") from None


class DraftHeadProposer:
    method = "draft_head"

    def __init__(self, runner, cfg: DraftHeadConfig, params: dict, vocab_map, num_speculative_tokens: int,
                 *, min_confidence: float = 0.0, precompile: bool = True):
        if not getattr(runner, "keep_hidden", False):
            raise ValueError("speculative_config.method='draft_head' needs a target runner built with "
                             "keep_hidden=True (engine/core/builder.py builds one)")
        model = runner.model_config
        if cfg.hidden_size != model.hidden_size or cfg.target_vocab_size != model.vocab_size:
            raise ValueError(f"speculative_config.model: the head was trained for hidden size "
                             f"{cfg.hidden_size} and {cfg.target_vocab_size} ids ({cfg.target or 'unknown target'}); "
                             f"the target has {model.hidden_size} and {model.vocab_size}")
        if int(np.max(vocab_map)) >= runner.sample_vocab_size or int(np.min(vocab_map)) < 0:
            raise ValueError("speculative_config.model: the head's vocab_map names ids outside the "
                             f"target's sampled vocabulary ({runner.sample_vocab_size})")
        self.runner = runner
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.min_confidence = min_confidence  # speculative_config.draft_confidence_threshold
        self.params = params
        self.shared = shared_from_target(runner.params, vocab_map)
        self.seq_buckets = tuple(runner.shapes.seq_buckets)
        self._fn = _propose_fn(cfg, self.k)
        self._hidden_shape = jax.ShapeDtypeStruct(
            (runner.shapes.max_logits, cfg.hidden_size),
            jnp.float32)
        self._compiled: dict[int, object] = {}
        if precompile:
            for s in self.seq_buckets:
                self._executable(s)

    def _executable(self, s: int):
        if s not in self._compiled:
            rows = jax.ShapeDtypeStruct((s,), jnp.int32)
            lowered = self._fn.lower(self.params, self.shared, self._hidden_shape, rows, rows)
            self._compiled[s] = lowered.compile(self.runner.compiler_options(s))  # the target's, for s rows
        return self._compiled[s]

    def propose(self, requests) -> list[list[int]]:
        rows_of = self.runner.hidden_rows
        hidden = self.runner.hidden
        index = [i for i, r in enumerate(requests) if r.req_id in rows_of]
        out: list[list[int]] = [[] for _ in requests]
        if not index or hidden is None:
            return out
        s = self.seq_buckets[min(bisect.bisect_left(self.seq_buckets, len(index)), len(self.seq_buckets) - 1)]
        drafts = []
        for start in range(0, len(index), s):  # more rows than the largest bucket: several calls
            chunk = index[start : start + s]
            rows = np.zeros(s, np.int32)
            tokens = np.zeros(s, np.int32)
            for j, i in enumerate(chunk):
                rows[j] = rows_of[requests[i].req_id]
                tokens[j] = requests[i].output_token_ids[-1] if requests[i].output_token_ids \
                    else requests[i].prompt_token_ids[-1]
            ids, confidence = jax.device_get(self._executable(s)(self.params, self.shared, hidden, rows, tokens))
            keep = (confidence[: len(chunk)] >= self.min_confidence).sum(axis=1)  # confidence never grows
            drafts += [d[:n] for d, n in zip(ids[: len(chunk)].tolist(), keep.tolist())]
        for i, d in zip(index, drafts):
            out[i] = d
        return out
