"""Trains the draft head (engine/spec_decode/draft_head.py) for a target by distillation, with optax.

    python -m experiments.train_draft --model=default \\
        --out=~/.cache/jaxserve/draft_heads/default

1. Prompts: first human turns of ShareGPT (ASCII, `--min_chars`..`--max_chars`), chat template
   applied, taken from record `--first_record` on: experiments/ideas/speculative.py's ShareGPT
   workload uses the first qualifying records of the file, so the head never trains on them. The
   first `--num_prompts` are for training, the next `--num_eval_prompts` are held out.
2. Collection: the target runs greedily (ignore_eos, `--output_len` tokens, as
   experiments/ideas/speculative.py does) in one engine without speculation whose runner keeps its
   final hidden states (`build_parts(keep_hidden=True)`). After every step each sampling row's
   hidden state (the position whose token it just sampled) is copied to the host, so output i of a
   request comes with h_i, the hidden state that produced it: no extra forward pass.
3. Draft vocabulary (`--draft_vocab_size`): the ids most frequent in the training outputs (ties
   and the rest by prompt frequency, then by id). Targets outside it are left out of the loss.
4. Training examples: every output position i with the chain of `--num_speculative_tokens`
   steps: feature h_i, tokens out[i .. i+k-1] fed (teacher forcing; at serving time the head feeds
   its own drafts, which only matters after a miss, when the rest is rejected anyway), targets
   out[i+1 .. i+k]. The head's own hidden state is fed back between steps exactly as when
   drafting, so gradients run through the chain. Cross-entropy over the draft vocabulary, summed
   over the chain; AdamW (warm-up, cosine decay, gradient clipping).
5. Held-out evaluation, drafting as the engine does (own drafts): top-1 acceptance (draft 1 equals
   the target's next greedy token), per-position acceptance given the earlier ones were accepted,
   and the mean accepted length (tokens per verification step, the bonus token included).
6. Saves the head (orbax + draft_head.json with the config and this summary) in `--out`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "default", "target model spec")
_OUT = flags.DEFINE_string("out", "~/.cache/jaxserve/draft_heads/default", "folder to save the head in")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 160, "training prompts")
_NUM_EVAL = flags.DEFINE_integer("num_eval_prompts", 32, "held-out prompts")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 128, "greedy tokens generated per prompt")
_FIRST_RECORD = flags.DEFINE_integer("first_record", 2000, "ShareGPT records before this are never used")
_MIN_CHARS = flags.DEFINE_integer("min_chars", 40, "shortest prompt text used")
_MAX_CHARS = flags.DEFINE_integer("max_chars", 700, "longest prompt text used")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "requests generated at once")
_K = flags.DEFINE_integer("num_speculative_tokens", 3, "chain length trained (k)")
_VOCAB = flags.DEFINE_integer("draft_vocab_size", 4096, "ids the head can draft")
_INTERMEDIATE = flags.DEFINE_integer("intermediate_size", 0, "head MLP width (0: the target's)")
_INIT_LAST = flags.DEFINE_bool("init_from_last_layer", False,
                               "start the head's block from the target's last layer (when the widths match)")
_STEPS = flags.DEFINE_integer("steps", 600, "optimizer steps")
_BATCH = flags.DEFINE_integer("batch_size", 128, "examples per step")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "peak AdamW learning rate")
_WD = flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay")
_SEED = flags.DEFINE_integer("seed", 0, "seed (init and batches)")
_NOISE = flags.DEFINE_float("feature_noise", 0.0, "std of Gaussian noise added to the input hidden state "
                            "(relative to its RMS) while training")
_W_HARD = flags.DEFINE_float("loss_hard", 1.0, "weight of the cross-entropy against the greedy token")
_W_SOFT = flags.DEFINE_float("loss_soft", 1.0, "weight of the cross-entropy against the target's distribution")
_W_FEAT = flags.DEFINE_float("loss_feature", 1.0, "weight of the hidden-state regression")
_DATA_CACHE = flags.DEFINE_string("data_cache", "", "npz file: reuse the collected data if present, "
                                  "else write it there ('' = collect every time)")


@dataclasses.dataclass
class Collected:
    feats: np.ndarray  # float32 [N, e]: hidden state that produced output token N
    tokens: np.ndarray  # int32 [N]: the output token
    starts: np.ndarray  # int64 [num_seqs + 1]: sequence offsets into feats / tokens
    prompt_tokens: np.ndarray  # int32 [P]: every prompt token (for the vocabulary's tie-break)
    num_train_seqs: int
    seconds: float


def sharegpt_prompts(tokenizer, n: int, first_record: int) -> list[list[int]]:
    from experiments.lab.datasets import iter_json_array, sharegpt_path

    out = []
    for i, record in enumerate(iter_json_array(sharegpt_path())):
        if i < first_record:
            continue
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0].get("value", "")
        if not (_MIN_CHARS.value <= len(text) <= _MAX_CHARS.value and text.isascii()):
            continue
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(tokenizer.encode(chat, add_special_tokens=False))
        if len(out) == n:
            return out
    raise ValueError(f"sharegpt: only {len(out)} usable prompts after record {first_record}, {n} asked")


def build_target(model: str, max_num_seqs: int, max_model_len: int):
    """A target engine without speculation whose runner keeps its hidden states, and the loaded
    model (the loaders' layout: a list of layers)."""
    from engine.config import EngineConfig
    from engine.core.builder import build_parts
    from engine.core.llm_engine import LLMEngine
    from models.loader import load_model

    blocks = max_num_seqs * -(-max_model_len // 16) + 1
    config = EngineConfig(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                          max_model_len=max_model_len, block_size=16, num_kv_blocks=blocks,
                          token_buckets=(max_num_seqs, 512), seq_buckets=(max_num_seqs,))
    import jax

    from engine.config import resolve_dtype

    loaded = load_model(model, dtype=resolve_dtype(config, jax.devices()[0].platform), progress=False)
    parts = build_parts(config, keep_hidden=True, progress=False, loaded=loaded)
    engine = LLMEngine.from_parts(config, scheduler=parts.scheduler, runner=parts.runner,
                                  tokenizer=parts.tokenizer, model_name=parts.model_name)
    engine.model_config = parts.model_config
    return engine, parts, loaded


def collect(engine, prompts: list[list[int]], output_len: int) -> tuple[list[np.ndarray], list[list[int]]]:
    """Greedy outputs of every prompt and, per output token, the hidden state that produced it."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    hidden: dict[str, list[np.ndarray]] = {f"p{i}": [] for i in range(len(prompts))}
    outputs: dict[str, list[int]] = {}
    runner = engine.runner
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        if runner.hidden_rows:
            h = np.asarray(runner.hidden)
            for rid, row in runner.hidden_rows.items():
                hidden[rid].append(h[row])
        for o in finished:
            outputs[o.request_id] = list(o.outputs[0].token_ids)
    feats, toks = [], []
    for i in range(len(prompts)):
        rid = f"p{i}"
        if len(hidden[rid]) != len(outputs[rid]):
            raise RuntimeError(f"{rid}: {len(hidden[rid])} hidden states for {len(outputs[rid])} tokens")
        feats.append(np.stack(hidden[rid]).astype(np.float32))
        toks.append(outputs[rid])
    return feats, toks


def draft_vocabulary(out_tokens: np.ndarray, prompt_tokens: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` ids most frequent in the outputs; ties (and ids never output) by prompt
    frequency, then by id."""
    out_counts = np.bincount(out_tokens, minlength=vocab)[:vocab].astype(np.float64)
    prompt_counts = np.bincount(prompt_tokens, minlength=vocab)[:vocab].astype(np.float64)
    score = out_counts * (prompt_counts.max() + 1) + prompt_counts
    order = np.lexsort((np.arange(vocab), -score))  # by score descending, then id
    return order[:size].astype(np.int32)


@dataclasses.dataclass
class Examples:
    """One chain per output position i of a sequence (all but its last)."""

    rows: np.ndarray  # [M] feature row of h_i (the chain's input)
    fed: np.ndarray  # int32 [M, k] tokens out[i .. i+k-1] fed at chain steps 0 .. k-1 (0 past the end)
    target: np.ndarray  # int32 [M, k] out[i+1 .. i+k], the target's greedy tokens; -1 past the end
    target_index: np.ndarray  # int32 [M, k] their index in the draft vocabulary; -1: none
    target_rows: np.ndarray  # [M, k] feature rows of h_{i+1 .. i+k} (what produced each target); -1 past the end


def examples(data: Collected, seqs: range, k: int, vocab_map: np.ndarray, vocab: int) -> Examples:
    inverse = np.full(vocab, -1, np.int32)
    inverse[vocab_map] = np.arange(len(vocab_map), dtype=np.int32)
    rows, fed, target, target_rows = [], [], [], []
    for s in seqs:
        a, b = int(data.starts[s]), int(data.starts[s + 1])
        n = b - a
        padded = np.concatenate([data.tokens[a:b], np.full(k + 1, -1, np.int32)])
        padded_rows = np.concatenate([np.arange(a, b), np.full(k + 1, -1)])
        for i in range(n - 1):  # the last output has no next token to predict
            rows.append(a + i)
            fed.append(np.maximum(padded[i : i + k], 0))
            target.append(padded[i + 1 : i + 1 + k])
            target_rows.append(padded_rows[i + 1 : i + 1 + k])
    target = np.asarray(target, np.int32)
    target_index = np.where(target >= 0, inverse[np.maximum(target, 0)], -1).astype(np.int32)
    return Examples(np.asarray(rows), np.asarray(fed, np.int32), target, target_index, np.asarray(target_rows))


def evaluate(chain_fn, params, shared, data: Collected, rows, target, k: int, batch: int = 512) -> dict:
    """Drafting as the engine does (own drafts after the first token): acceptance per position and
    the mean accepted length over positions with k targets."""
    accepted = []
    for i in range(0, len(rows), batch):
        r = rows[i : i + batch]
        drafts = np.asarray(chain_fn(params, shared, data.feats[r], data.tokens[r][:, None]))
        match = drafts == target[i : i + batch]
        accepted.append(np.cumprod(match, axis=1).sum(axis=1))
    accepted = np.concatenate(accepted)
    full = (target >= 0).all(axis=1)
    acc = accepted[full]
    per_pos = [float((acc > j).sum() / max(1, (acc >= j).sum())) for j in range(k)]
    return {"top1_acceptance": float((acc >= 1).mean()), "acceptance_per_position": per_pos,
            "mean_accepted_length": float(1 + acc.mean()), "num_positions": int(full.sum())}


def main(argv) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import optax

    from engine.spec_decode.draft_head import (
        DraftHeadConfig,
        draft_chain,
        init_params,
        num_params,
        save_head,
        shared_from_target,
    )
    from models.llama import rms_norm

    k = _K.value
    out_dir = os.path.expanduser(_OUT.value)
    t_start = time.perf_counter()
    n_train, n_eval = _NUM_PROMPTS.value, _NUM_EVAL.value
    max_model_len = 16 * -(-(512 + _OUTPUT_LEN.value + 1) // 16)
    engine, parts, loaded = build_target(_MODEL.value, min(_MAX_SEQS.value, n_train + n_eval), max_model_len)
    tokenizer, model_config = parts.tokenizer, parts.model_config
    vocab = model_config.vocab_size
    print(f"target {_MODEL.value} ({parts.model_name}) built in {time.perf_counter() - t_start:.1f} s", flush=True)

    cache = os.path.expanduser(_DATA_CACHE.value) if _DATA_CACHE.value else ""
    if cache and os.path.exists(cache):
        z = np.load(cache)
        data = Collected(z["feats"], z["tokens"], z["starts"], z["prompt_tokens"], int(z["num_train_seqs"]),
                         float(z["seconds"]))
        print(f"collected data reused from {cache}: {len(data.tokens)} positions", flush=True)
    else:
        prompts = [p[-512:] for p in sharegpt_prompts(tokenizer, n_train + n_eval, _FIRST_RECORD.value)]
        t0 = time.perf_counter()
        feats, toks = collect(engine, prompts, _OUTPUT_LEN.value)
        seconds = time.perf_counter() - t0
        starts = np.concatenate([[0], np.cumsum([len(t) for t in toks])])
        data = Collected(np.concatenate(feats), np.concatenate(toks).astype(np.int32), starts,
                         np.concatenate([np.asarray(p, np.int32) for p in prompts[:n_train]]), n_train, seconds)
        print(f"collected {len(data.tokens)} positions from {len(prompts)} prompts in {seconds:.1f} s", flush=True)
        if cache:
            os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
            np.savez(cache, **{f.name: getattr(data, f.name) for f in dataclasses.fields(data)})
    train_seqs, eval_seqs = range(data.num_train_seqs), range(data.num_train_seqs, len(data.starts) - 1)

    train_tokens = data.tokens[: data.starts[data.num_train_seqs]]
    vocab_map = draft_vocabulary(train_tokens, data.prompt_tokens, _VOCAB.value, min(vocab, parts.runner.sample_vocab_size))
    cfg = DraftHeadConfig.for_target(model_config, draft_vocab_size=len(vocab_map),
                                     intermediate_size=_INTERMEDIATE.value or None,
                                     target=_MODEL.value, num_speculative_tokens=k)
    target_params = engine.runner.params
    last = None
    if _INIT_LAST.value:
        layers = loaded.params["layers"]
        last = layers[-1] if isinstance(layers, list) else {n: w[-1] for n, w in layers.items()}
    params = init_params(cfg, jax.random.key(_SEED.value), last)
    shared = shared_from_target(target_params, vocab_map)
    del engine, loaded  # the target's KV cache is not needed any more

    train = examples(data, train_seqs, k, vocab_map, vocab)
    held = examples(data, eval_seqs, k, vocab_map, vocab)
    coverage = float((held.target_index[:, 0] >= 0).sum() / max(1, (held.target[:, 0] >= 0).sum()))
    print(f"head: {num_params(params) / 1e6:.2f} M parameters, draft vocabulary {len(vocab_map)} ids "
          f"(covers {coverage:.3f} of held-out next tokens); {len(train.rows)} training / {len(held.rows)} "
          f"held-out positions", flush=True)

    schedule = optax.warmup_cosine_decay_schedule(0.0, _LR.value, max(1, _STEPS.value // 20), max(1, _STEPS.value),
                                                  _LR.value * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=_WD.value))
    opt_state = optimizer.init(params)
    eps = cfg.rms_norm_eps
    w_hard, w_soft, w_feat = _W_HARD.value, _W_SOFT.value, _W_FEAT.value

    def loss_fn(p, feat, fed, index, target_feat, key):
        """Per chain step: cross-entropy against the target's greedy token (hard), against the
        target's own distribution there over the draft vocabulary (soft: its logits come from
        the recorded hidden state h_{i+1+j}), and a smooth-L1 distance between the head's hidden
        state and h_{i+1+j} (both RMS-normalised; EAGLE's feature loss)."""
        rms = jnp.sqrt(jnp.mean(feat * feat, axis=-1, keepdims=True))
        feat = feat + _NOISE.value * rms * jax.random.normal(key, feat.shape)
        logits, _, head_feat = draft_chain(p, shared, cfg, feat, fed, k)
        logp = jax.nn.log_softmax(logits, axis=-1)
        valid = index >= 0
        count = jnp.maximum(1, jnp.sum(valid, axis=0))
        hard = -jnp.take_along_axis(logp, jnp.maximum(index, 0)[..., None], axis=-1)[..., 0]
        target_logits = rms_norm(target_feat, shared["final_norm"], eps) @ shared["lm_draft"]
        soft = -jnp.sum(jax.nn.softmax(target_logits, axis=-1) * logp, axis=-1)
        has_feat = jnp.any(target_feat != 0, axis=-1)
        diff = rms_norm(head_feat, jnp.ones(cfg.hidden_size), eps) - rms_norm(target_feat, jnp.ones(cfg.hidden_size), eps)
        feat_loss = jnp.mean(optax.huber_loss(diff), axis=-1)
        per_pos = (w_hard * jnp.sum(hard * valid, axis=0) + w_soft * jnp.sum(soft * has_feat, axis=0)
                   + w_feat * jnp.sum(feat_loss * has_feat, axis=0)) / count
        return jnp.sum(per_pos), jnp.sum(hard * valid, axis=0) / count

    @jax.jit
    def train_step(p, state, feat, fed, index, target_feat, key):
        (loss, hard), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, feat, fed, index, target_feat, key)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, hard

    chain_fn = jax.jit(lambda p, s, feat, tok: draft_chain(p, s, cfg, feat, tok, k)[1])
    zero = np.zeros((1, cfg.hidden_size), np.float32)
    feats_or_zero = np.concatenate([data.feats, zero])  # row -1: past the end (no feature target)
    keys = jax.random.split(jax.random.key(_SEED.value + 1), max(1, _STEPS.value))

    rng = np.random.default_rng(_SEED.value)
    t0 = time.perf_counter()
    for step in range(_STEPS.value):
        b = rng.integers(0, len(train.rows), _BATCH.value)
        params, opt_state, loss, hard = train_step(params, opt_state, data.feats[train.rows[b]], train.fed[b],
                                                   train.target_index[b], feats_or_zero[train.target_rows[b]],
                                                   keys[step])
        if step % 50 == 0 or step == _STEPS.value - 1:
            print(f"step {step:5d} loss {float(loss):.3f} hard cross-entropy per position "
                  f"{' '.join(f'{x:.2f}' for x in np.asarray(hard))} ({time.perf_counter() - t0:.0f} s)", flush=True)
    train_seconds = time.perf_counter() - t0
    held_out = evaluate(chain_fn, params, shared, data, held.rows, held.target, k)
    sub = np.random.default_rng(1).choice(len(train.rows), min(len(train.rows), len(held.rows)), replace=False)
    train_eval = evaluate(chain_fn, params, shared, data, train.rows[sub], train.target[sub], k)
    summary = {
        "target": _MODEL.value, "command": "python -m experiments.train_draft " + " ".join(
            f"--{n}={flags.FLAGS[n].value}" for n in ("model", "num_prompts", "num_eval_prompts", "output_len",
                                                      "num_speculative_tokens", "draft_vocab_size",
                                                      "intermediate_size", "steps", "batch_size", "learning_rate",
                                                      "weight_decay", "loss_hard", "loss_soft", "loss_feature",
                                                      "feature_noise", "init_from_last_layer", "seed")),
        "num_params": num_params(params), "draft_vocab_size": len(vocab_map),
        "held_out_vocab_coverage": coverage, "train_positions": len(train.rows), "held_out_positions": len(held.rows),
        "collect_seconds": data.seconds, "train_seconds": train_seconds, "held_out": held_out, "train": train_eval,
    }
    save_head(out_dir, cfg, params, vocab_map, summary)
    print(json.dumps({"held_out": held_out, "train": train_eval}, indent=1))
    print(f"held-out top-1 acceptance {held_out['top1_acceptance']:.3f}, mean accepted length "
          f"{held_out['mean_accepted_length']:.2f} (k={k}); saved to {out_dir} "
          f"({time.perf_counter() - t_start:.0f} s in all)", flush=True)


if __name__ == "__main__":
    app.run(main)
