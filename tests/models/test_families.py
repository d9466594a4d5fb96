"""The newer families against transformers: Qwen3, Gemma 2, Gemma 3 (text), Mixtral, Qwen3-MoE.

Fixtures (tests/fixtures/hf_family/, by scripts/make_family_fixtures.py): tiny random models saved
by transformers 5.24 (Mixtral as sharded safetensors with an index), with transformers' float32
last-position logits and greedy tokens for three prompts that cross the 4-token windows.

1. The folder loads, its config reads every family feature, and the dense forward's
   last-position logits match transformers' within 1e-4.
2. The engine (paged cache, served layout, switch layer scan) serves transformers' greedy tokens
   with the prompts batched, prefilled in chunks, the third prompt sharing the first's prefix
   blocks (prefix caching) and too few KV blocks for all at once (preemption by recompute).
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.hf_config import read_hf_config
from models.hf_loader import load_hf_folder
from models.llama import forward_dense

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf_family"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
NAMES = sorted(REFERENCE["models"])
pytestmark = pytest.mark.usefixtures("fast_compile")  # tiny shapes: -O0 (tests/conftest.py)
PAD = 32  # one padded length for every prompt (causal: padding changes nothing before it)


@pytest.fixture(scope="module")
def reference_logits():
    with np.load(FIXTURES / "reference.npz") as f:
        return dict(f)


def test_configs_read_each_family_feature():
    qwen3 = read_hf_config(FIXTURES / "qwen3")
    assert qwen3.qk_norm and not qwen3.tie_word_embeddings and qwen3.norm_offset == 0
    g2 = read_hf_config(FIXTURES / "gemma2")
    assert (g2.norm_offset, g2.embed_scale, g2.hidden_act, g2.sandwich_norms) == (1.0, True, "gelu_tanh", True)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (5.0, 3.0, 24.0)
    assert g2.layer_kinds == ("sliding_attention", "full_attention") and g2.sliding_window == 4
    g3 = read_hf_config(FIXTURES / "gemma3_text")
    assert g3.qk_norm and g3.attn_logit_softcap is None and g3.layer_period == 3
    assert (g3.rope_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert g3.rope_of("sliding_attention") == (1e4, None)
    mix = read_hf_config(FIXTURES / "mixtral")
    assert (mix.num_experts, mix.num_experts_per_tok, mix.norm_topk_prob) == (4, 2, True)
    moe = read_hf_config(FIXTURES / "qwen3_moe")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_size, moe.norm_topk_prob) == (8, 3, 32, False)
    assert (FIXTURES / "mixtral" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("name", NAMES)
def test_dense_forward_matches_transformers(name, reference_logits):
    config, params = load_hf_folder(FIXTURES / name, progress=False)
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    for i, prompt in enumerate(REFERENCE["prompts"]):
        ids = np.zeros(PAD, np.int32)
        ids[: len(prompt)] = prompt
        got = np.asarray(forward(params, jnp.asarray(ids)))[len(prompt) - 1]
        np.testing.assert_allclose(got, reference_logits[f"{name}/last_{i}"], atol=1e-4, rtol=0,
                                   err_msg=f"{name} prompt {i}")


@pytest.mark.parametrize("name", NAMES)
def test_engine_serves_transformers_greedy_tokens(name):
    from engine import LLM, SamplingParams

    # 12 blocks of 4 tokens hold two of the (up to 28-token) sequences, not three: the newest
    # is preempted and recomputed; a 16-token budget prefills in chunks.
    llm = LLM(str(FIXTURES / name), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              num_kv_blocks=17, block_size=4, token_buckets=(16,), seq_buckets=(4,),
              enable_prefix_caching=True, prompt_scoring_bucket=False)
    prompts = [list(p) for p in REFERENCE["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:1], params, use_tqdm=False)
    want = REFERENCE["greedy"][name]
    assert [o.outputs[0].token_ids for o in outs] == want + want[:1]
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # Gemma mixes sliding and global layers: a cache group per kind (scheduler/sliding_window.py).
    assert len(llm.engine.runner.kv_cache) == (4 if name.startswith("gemma") else 2)
