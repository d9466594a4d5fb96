"""Shared by the LoRA engine tests (test_lora.py, test_lora_spec.py): random:tiny knobs, random PEFT
adapters with each one's merged model (W + scale * B A, models/lora.merge_lora), and the checks
that an engine's greedy output is the merged model's (teacher forced through the dense forward).
"""

import jax
import jax.numpy as jnp
import numpy as np

from engine.lora_config import LoRARequest
from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from models.loader import load_model
from models.lora import load_peft_adapter, merge_lora
from tests.models.lora_files import write_adapter

KNOBS = dict(model="random:tiny", enable_lora=True, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=32,
             max_model_len=96, block_size=16, num_kv_blocks=6 * 8 + 1, token_buckets=(32,), seq_buckets=(8,),
             compilation_cache_dir=None, prompt_scoring_bucket=False)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, alpha, targets, rsLoRA) of the eight adapters
SPECS = [(8, 16, ALL, False), (4, 8, ("q_proj", "v_proj"), False), (2, 4, ("o_proj", "down_proj"), True),
         (8, 8, ("gate_proj", "up_proj"), False), (3, 6, ("k_proj", "o_proj", "up_proj"), False),
         (6, 12, ALL, True), (1, 2, ("q_proj", "down_proj"), False), (5, 5, ("v_proj", "gate_proj"), False)]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
# A JSON schema whose greedy completions stay short on random:tiny (bounded enum and integer).
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["ab", "cd", "ef"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["k", "n"], "additionalProperties": False}
PROMPTS = ["The quick brown fox", "LoRA adapters, many at once", "0123456789 abcdefghij klmnop",
           "Hi", "Serving research engines"]


def build_setup(folder, num_adapters: int = len(SPECS)) -> dict:
    """The first `num_adapters` adapters of SPECS written under `folder`, their LoRARequests
    (ids 1..), their merged models, the prompts' ids, and `reference(which, prompt, tokens)`: the
    merged model's dense log-softmax [len(tokens), vocab] at the positions that sampled `tokens`
    (which: 0 the base, i + 1 adapter i)."""
    base = load_model("random:tiny")
    config = base.config
    paths = [write_adapter(folder / f"a{i}", config, rank=r, alpha=a, targets=t, rslora=rs, seed=10 + i, b_std=0.5)
             for i, (r, a, t, rs) in enumerate(SPECS[:num_adapters])]
    requests = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    dense = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    merged = [base.params] + [merge_lora(base.params, config, load_peft_adapter(p, config, 8)) for p in paths]
    tok = base.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS]

    def reference(which, prompt, tokens):
        ids = list(prompt) + list(tokens)
        x = np.zeros(128, np.int32)
        x[: len(ids)] = ids
        logits = np.asarray(dense(jax.tree.map(jnp.asarray, merged[which]), jnp.asarray(x)))
        return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1 : len(ids) - 1], axis=-1))

    return dict(folder=folder, config=config, requests=requests, paths=paths, reference=reference, prompts=prompts)


def run_jobs(engine, jobs, params=GREEDY):
    """jobs: (request id, prompt ids, LoRARequest or None[, SamplingParams]) -> ({request id:
    RequestOutput}, the most distinct adapters that ran in one step). Ends with an empty step, so
    the finished requests also leave the runner's table (engines here may share a runner)."""
    for rid, prompt, lora, *own in jobs:
        engine.add_request(rid, prompt, own[0] if own else params, **({"lora_request": lora} if lora else {}))
    outs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        most = max(most, len(engine.scheduler.lora_seats.active))
    engine.step()
    return outs, most


def check_greedy(setup, which, prompt, out, new_tokens: int = NEW_TOKENS):
    """Greedy tokens are the merged model's argmax; the first one's logprob (the prompt's last
    position) its log-softmax within 1e-4, the later ones' within 3e-4 (float32: the unmerged
    products round differently from the merged weights, and the differences ride in the cache)."""
    completion = out.outputs[0]
    assert completion.error is None and len(completion.token_ids) == new_tokens
    logp = setup["reference"](which, prompt, completion.token_ids)
    assert completion.token_ids == np.argmax(logp, axis=-1).tolist(), f"adapter {which}"
    got = np.array([lp[t] for lp, t in zip(completion.logprobs, completion.token_ids)])
    want = logp[np.arange(new_tokens), completion.token_ids]
    assert abs(got[0] - want[0]) < 1e-4
    np.testing.assert_allclose(got, want, atol=3e-4)
