"""Sliding-window block accounting in the engine (issue 29): random:tiny-gemma3 (window 8; layers
sliding, sliding, global, sliding: a period of 3 and a tail layer after the scan) runs with a cache
group per layer kind (engine/step/kv_cache.py, scheduler/sliding_window.py), 4-token blocks.

One engine: a request alone up to 8 windows of context holds its window's sliding blocks, not its
length's, and less than half the KV of the same model with every layer global; then requests up
to 10 windows long, batched, chunked, one sharing the first's prompt (a prefix hit, which needs
the sliding blocks of its last window) and too few global blocks for all (preemption). Every
output equals the dense forward's greedy tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.builder import uses_sliding_groups
from engine.step.kv_cache import cache_groups
from models.config import preset_config
from models.llama import forward_dense

pytestmark = pytest.mark.usefixtures("fast_compile")  # tiny shapes: -O0 (tests/conftest.py)
WINDOW, BS, MAX_LEN = 8, 4, 80


def dense_greedy(params, config, prompts: dict, max_tokens: dict) -> dict:
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    out = {}
    for rid, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(max_tokens[rid]):
            ids = np.zeros(MAX_LEN, np.int32)
            ids[: len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(forward(params, jnp.asarray(ids)))[len(seq) - 1])))
        out[rid] = seq[len(prompt):]
    return out


def run(engine, prompts: dict, max_tokens: dict) -> tuple[dict, list]:
    """Greedy outputs, and (global, sliding) blocks in use after each step."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True))
    outs, held = {}, []
    kv = engine.scheduler.kv_cache_manager
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        held.append((kv.pool.num_used_blocks, kv.sliding.pool.num_used_blocks))
        assert engine.get_stats().num_sliding_used_blocks == held[-1][1]  # reported (and in /metrics)
    return outs, held


def test_tiny_gemma3_frees_passed_blocks_and_equals_dense():
    llm = LLM("random:tiny-gemma3", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN,
              block_size=BS, num_kv_blocks=41, token_buckets=(16,), seq_buckets=(4,),
              enable_prefix_caching=True, prompt_scoring_bucket=False)
    engine = llm.engine
    config = engine.model_config
    assert config.sliding_window == WINDOW and config.layer_kinds.count("full_attention") == 1
    k_global, _, k_sliding, _ = engine.runner.kv_cache  # two groups: [1, 41, ...], [3, 21, ...]
    assert (k_global.shape[:2], k_sliding.shape[:2]) == ((1, 41), (3, 21))
    rng = np.random.default_rng(0)
    prompt = lambda n: [int(t) for t in rng.integers(1, 250, n)]  # noqa: E731

    # Alone: 56 prompt tokens, then decodes to 8 windows (64 tokens).
    alone = {"a": prompt(56)}
    outs, held = run(engine, alone, {"a": 8})
    num_global, num_sliding = held[-2]  # the last step before it finished: 63 tokens computed
    assert num_global == 16 and num_sliding <= 3
    # KV held, in layer-blocks: 1 global layer x 16 blocks + 3 sliding layers x <= 3 blocks,
    # against 4 layers x 16 blocks with every layer global.
    assert (1 * num_global + 3 * num_sliding) / (4 * num_global) <= 0.5
    assert max(s for _, s in held) <= 3  # between steps: the blocks of one window (7 tokens back)

    # Batched and chunked, a prefix hit, and preemption (the sequences need 54 global blocks).
    # "a2" goes first, so no allocation evicts a's cached blocks before its hit.
    prompts = {"a2": alone["a"] + prompt(3), "b": prompt(45), "c": prompt(21), "d": prompt(60)}
    max_tokens = {"a2": 8, "b": 10, "c": 12, "d": 8}
    outs2, _ = run(engine, prompts, max_tokens)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    want = dense_greedy(engine.runner.params, config, {**alone, **prompts}, {"a": 8, **max_tokens})
    assert {**outs, **outs2} == want
    assert stats.num_used_blocks == stats.num_sliding_used_blocks == 0


def test_one_group_unless_the_model_has_sliding_layers():
    paged = EngineConfig()
    assert uses_sliding_groups(paged, preset_config("tiny-gemma3"))
    assert uses_sliding_groups(paged, preset_config("gemma2-9b"))
    assert not uses_sliding_groups(paged, preset_config("tiny"))
    assert uses_sliding_groups(paged, preset_config("mistral-7b"))  # every layer slides: the sliding group alone
    draft = EngineConfig(speculative_config={"method": "draft_model", "model": "random:tiny",
                                             "num_speculative_tokens": 2})
    assert not uses_sliding_groups(draft, preset_config("mistral-7b"))  # a draft reads the global tables
    assert uses_sliding_groups(draft, preset_config("tiny-gemma3"))
    # How a runner lays the pools out (engine/step/kv_cache.py): one group, two, or the sliding one alone.
    assert cache_groups(preset_config("tiny"), 33, 0) == (33, 0, "global")
    assert cache_groups(preset_config("tiny-gemma3"), 33, 14) == (33, 14, "both")
    assert cache_groups(preset_config("mistral-7b"), 513, 40) == (40, 0, "sliding")
    assert not uses_sliding_groups(EngineConfig(disable_hybrid_kv_cache_manager=True), preset_config("tiny-gemma3"))
    assert not uses_sliding_groups(EngineConfig(kv_allocation="contiguous"), preset_config("tiny-gemma3"))
    assert not uses_sliding_groups(EngineConfig(policy="static"), preset_config("tiny-gemma3"))


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_kernels_read_the_sliding_tables(backend, monkeypatch):
    """The Pallas kernels (interpret mode) get each group's tables and sample the xla path's
    tokens (seeded, at a high temperature: every logit counts) at 6 windows of context (the
    sliding tables' leading entries null). "pallas"
    means the GPU kernel on the CPU; the TPU kernel is chosen by patching the builder's pick."""
    from engine.core import builder
    # The GPU kernel takes blocks of 16 tokens or more: two windows a block, released from 24 on.
    knobs = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=MAX_LEN, block_size=16,
                 num_kv_blocks=12, token_buckets=(16,), seq_buckets=(2,), prompt_scoring_bucket=False)
    prompts = [[(5 * k + 3) % 250 + 2 for k in range(n)] for n in (20, 40)]
    params = [SamplingParams(temperature=40.0, seed=i, max_tokens=10, ignore_eos=True) for i in range(2)]
    outs = {}
    for name, extra in (("xla", {}), (backend, dict(attention_backend="pallas", interpret=True))):
        if name == "pallas_tpu":
            monkeypatch.setattr(builder, "resolve_backend", lambda *_: "pallas_tpu")
        llm = LLM("random:tiny-gemma3", **knobs, **extra)
        assert llm.engine.attention_backend == name
        assert len(llm.engine.runner.kv_cache) == 4
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["xla"] == outs[backend]
