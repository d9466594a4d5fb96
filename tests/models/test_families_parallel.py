"""Tensor and expert parallelism of the newer families on the tests' 4 host devices: TP = 2 gives
one device's greedy tokens and first logprobs (Gemma 3's q/k and sandwich norms, scaled
vocab-parallel embedding and local/global layers); expert parallelism (EP = 2 of TP = 2: each device holds half the experts, whole) and EP = 2 x
MLP split 2 (TP = 4) give them too, and the compiled MoE step keeps the Megatron pattern: two
all-reduces of the residual stream per layer, no all-gather of any weight."""

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion
from tests.engine.test_tensor_parallel import _collectives

# Tensor and expert parallel over virtual devices: make test-extended (CI runs it after make test).
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.extended]
KNOBS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=40,
             token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None,
             prompt_scoring_bucket=False)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(30, 52))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)


def _run(model, loaded, **parallel):
    from engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, **KNOBS, **parallel), progress=False, loaded=loaded)
    done = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    return engine, [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]


def _same(a_outs, b_outs):
    for a, b in zip(a_outs, b_outs):
        assert a.token_ids == b.token_ids
        assert abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0][b.token_ids[0]]) < 1e-4


@pytest.mark.parametrize("model,layouts", [
    ("random:tiny-gemma3", [dict(tensor_parallel_size=2)]),
    # Qwen3-MoE has Qwen3's q/k norms too.
    ("random:tiny-qwen3-moe", [dict(tensor_parallel_size=2, expert_parallel_size=2),
                               dict(tensor_parallel_size=4, expert_parallel_size=2)]),
])
def test_parallel_equals_one_device(model, layouts):
    from models.loader import load_model

    loaded = load_model(model, host=True, progress=False)
    _, one = _run(model, loaded)
    for parallel in layouts:
        engine, outs = _run(model, loaded, **parallel)
        _same(one, outs)
        if parallel.get("expert_parallel_size", 1) > 1:
            layer = engine.runner.params["layers"][0]
            tp, ep = parallel["tensor_parallel_size"], parallel["expert_parallel_size"]
            w = layer["experts_gate_up"]
            experts = engine.model_config.num_experts
            assert w.shape[0] == tp * experts // ep  # device after device: its group's experts
            assert {s.data.shape[0] for s in w.addressable_shards} == {experts // ep}
            hlo = engine.runner._compiled[engine.runner.shapes.buckets()[0]].as_text()
            found = _collectives(hlo)
            residual = f"f32[16,{engine.model_config.hidden_size}]"
            body = [n for n in found if n != "ENTRY"]
            assert len(body) == 1 and found[body[0]] == [("all-reduce", residual)] * 2, found
            assert sorted(op for op, _ in found["ENTRY"]) == ["all-gather", "all-reduce"]


def test_expert_parallel_size_is_validated_by_name():
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=3)
    from models.config import preset_config
    from models.sharding import tp_layout

    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide"):
        tp_layout(preset_config("tiny-qwen3"), 2, 2)  # not a mixture of experts
