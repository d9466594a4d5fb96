"""LoRA under tensor parallelism (TP = 2 over virtual CPU devices, random:tiny-gqa3: 9 q / 3 KV
heads padded to 12 / 4, MLP width 90 padded to 92): the adapter matrices are split like the base
layers they modify (column-parallel q/k/v and gate/up: B by output rows in the per-shard fused
order, A replicated; row-parallel o/down: A by input columns, B replicated), so the step keeps
the Megatron pattern (two all-reduces per layer, no more), and greedy output of the base model
and two adapters in one batch equals each merged model's dense forward on one device."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.lora_config import LoRARequest
from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from models.loader import load_model
from models.lora import load_peft_adapter, merge_lora
from tests.engine.hlo_collectives import collectives_by_computation
from tests.models.lora_files import write_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             num_kv_blocks=4 * 4 + 1, token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None,
             prompt_scoring_bucket=False, enable_lora=True, max_loras=2, max_lora_rank=8,
             tensor_parallel_size=2, stack_layer_weights=True)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from engine.core.llm_engine import LLMEngine

    folder = tmp_path_factory.mktemp("tp_adapters")
    loaded = load_model("random:tiny-gqa3", host=True, progress=False)
    paths = [write_adapter(folder / "all", loaded.config, rank=4, alpha=8, targets=ALL, seed=1, b_std=0.5),
             write_adapter(folder / "qv", loaded.config, rank=8, alpha=16, rslora=True, seed=2, b_std=0.5)]
    engine = LLMEngine(EngineConfig(**KNOBS), progress=False, loaded=loaded)
    return loaded, paths, engine


def test_adapters_under_tp2_equal_merged_models_and_keep_two_all_reduces_per_layer(setup):
    loaded, paths, engine = setup
    config = loaded.config
    found = collectives_by_computation(engine.runner._compiled[engine.runner.shapes.buckets()[0]].as_text())
    body = [n for n in found if n != "ENTRY"]
    assert len(body) == 1 and found[body[0]] == ["all-reduce"] * 2, found
    assert sorted(found["ENTRY"]) == ["all-gather", "all-reduce"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    loras = [None, LoRARequest("all", 1, paths[0]), LoRARequest("qv", 2, paths[1])]
    prompts = [[5, 9, 17, 33, 2, 8, 90, 14, 3], [7, 7, 1, 200, 13, 41, 4], [100, 3, 66, 12, 19, 27, 8, 8, 1, 5]]
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", prompt, params, **({"lora_request": lora} if lora else {}))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    dense = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    base = jax.tree.map(jnp.asarray, loaded.params)
    references = [base] + [merge_lora(base, config, load_peft_adapter(p, config, 8)) for p in paths]
    for i, (prompt, ref) in enumerate(zip(prompts, references)):
        ids = prompt + outs[f"r{i}"]
        x = np.zeros(32, np.int32)
        x[: len(ids)] = ids
        logits = np.asarray(dense(jax.tree.map(jnp.asarray, ref), jnp.asarray(x)))
        assert outs[f"r{i}"] == np.argmax(logits[len(prompt) - 1 : len(ids) - 1], -1).tolist(), f"row {i}"
    assert outs["r1"] != outs["r0"] and outs["r2"] != outs["r0"]
