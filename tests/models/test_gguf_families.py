"""GGUF for the newer families: each transformers-saved fixture (tests/fixtures/hf_family/) written
as llama.cpp's converter writes it (tests/models/gguf_writer.py: qwen3, qwen3moe, gemma2, gemma3,
Mixtral as "llama" with stacked experts) loads to the same weights and, where the format can say
what the folder says, the same config and transformers' logits; metadata llama.cpp would run
differently is refused by name (models/gguf_config.py)."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models.gguf_config import config_from_gguf
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_folder
from models.llama import forward_dense
from tests.models.gguf_writer import GGUF_ARCH, write_gguf

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf_family"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
NAMES = sorted(REFERENCE["models"])
PAD = 32
pytestmark = pytest.mark.usefixtures("fast_compile")

# What a GGUF cannot say and llama.cpp fixes instead, where the fixture differs: the value the
# GGUF model runs with. Gemma 2: query_pre_attn_scalar is the head dimension (24 in the folder);
# Gemma 3: every sixth layer is global (every third in the folder: its 4 layers all slide);
# Qwen3-MoE: the top-k weights are always renormalized (norm_topk_prob false in the folder).
CANNOT_SAY = {
    "gemma2": dict(query_pre_attn_scalar=16.0),
    "gemma3_text": dict(layer_types=("sliding_attention",) * 4),
    "qwen3_moe": dict(norm_topk_prob=True),
}
GEMMA = ("gemma2", "gemma3_text")


def _last_logits(params, config):
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    out = []
    for prompt in REFERENCE["prompts"]:
        ids = np.zeros(PAD, np.int32)
        ids[: len(prompt)] = prompt
        out.append(np.asarray(forward(params, jnp.asarray(ids)))[len(prompt) - 1])
    return out


def _leaves(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", NAMES)
def test_gguf_of_each_family_is_the_folder_model(name, tmp_path):
    hf_config, hf_params = load_hf_folder(FIXTURES / name, progress=False)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, hf_config, hf_params)
    config, params, _ = load_gguf(path, progress=False)
    assert abs(config.rms_norm_eps - hf_config.rms_norm_eps) < 1e-12  # stored as float32
    # Gemma: the file holds 1 + w, so the GGUF model scales by the stored weight.
    offset = dict(norm_offset=0.0) if name in GEMMA else {}
    assert config == dataclasses.replace(hf_config, name=config.name, rms_norm_eps=config.rms_norm_eps,
                                         **CANNOT_SAY.get(name, {}), **offset)
    want = _leaves(hf_params)
    for key, got in _leaves(params).items():
        expected = want[key] + (1.0 if name in GEMMA and "norm" in key else 0.0)
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=key)
    assert want.keys() == _leaves(params).keys()
    if name in CANNOT_SAY:  # the folder's weights, run as llama.cpp would run them
        runs_as = dataclasses.replace(hf_config, **CANNOT_SAY[name])
        for got, ref in zip(_last_logits(params, config), _last_logits(hf_params, runs_as), strict=True):
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=name)
    else:  # the very model transformers ran
        with np.load(FIXTURES / "reference.npz") as f:
            for i, got in enumerate(_last_logits(params, config)):
                np.testing.assert_allclose(got, f[f"{name}/last_{i}"], atol=1e-4, rtol=0, err_msg=name)


def test_quantized_experts_load_as_the_file_decodes_them(tmp_path):
    hf_config, hf_params = load_hf_folder(FIXTURES / "qwen3_moe", progress=False)
    path = tmp_path / "q8.gguf"
    decoded = write_gguf(path, hf_config, hf_params, qtype=Q.Q8_0)
    _, params, _ = load_gguf(path, progress=False)
    layer = params["layers"][1]
    gate_up = np.concatenate([decoded["blk.1.ffn_gate_exps.weight"], decoded["blk.1.ffn_up_exps.weight"]], 1)
    np.testing.assert_array_equal(np.asarray(layer["experts_gate_up"]), gate_up)
    np.testing.assert_array_equal(np.asarray(layer["experts_down"]), decoded["blk.1.ffn_down_exps.weight"])
    np.testing.assert_allclose(gate_up, np.asarray(hf_params["layers"][1]["experts_gate_up"]), atol=0.02)


def _meta(arch, **keys):
    meta = {"general.architecture": arch}
    base = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
            "vocab_size": 128, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 16, "attention.layer_norm_rms_epsilon": 1e-6}
    meta.update({f"{arch}.{k}": v for k, v in {**base, **keys}.items()})
    return meta


TENSORS = {"output.weight", "blk.0.attn_q.weight"}


def test_llama_cpp_conventions_apply():
    # Gemma's 27B shapes: query_pre_attn_scalar = hidden / heads (Gemma 2: 46 layers, Gemma 3: 62).
    g2 = config_from_gguf(_meta("gemma2", block_count=46, embedding_length=4608, **{
        "attention.head_count": 32, "attention.head_count_kv": 16, "attention.key_length": 128}), "g", TENSORS)
    assert g2.query_pre_attn_scalar == 144.0 and g2.layer_kinds[:2] == ("sliding_attention", "full_attention")
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.sliding_window) == (50.0, 30.0, 4096)
    g3 = config_from_gguf(_meta("gemma3", block_count=12, **{"attention.sliding_window": 512}), "g", TENSORS)
    assert g3.query_pre_attn_scalar == 16.0 and g3.layer_period == 6 and g3.qk_norm
    assert g3.rope_of("sliding_attention") == (10000.0, None) and g3.norm_offset == 0.0
    no_window = config_from_gguf(_meta("gemma3"), "g", TENSORS)
    assert no_window.layer_types is None and no_window.sliding_window is None
    mix = config_from_gguf(_meta("llama", expert_count=8, expert_used_count=2), "m", TENSORS)
    assert (mix.architecture, mix.num_experts, mix.num_experts_per_tok, mix.norm_topk_prob) == ("mixtral", 8, 2, True)
    moe = config_from_gguf(_meta("qwen3moe", expert_count=8, expert_used_count=2,
                                 expert_feed_forward_length=32), "q", TENSORS)
    assert (moe.architecture, moe.expert_size, moe.norm_topk_prob, moe.qk_norm) == ("qwen3_moe", 32, True, True)
    assert set(GGUF_ARCH.values()) <= {"llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3"}


@pytest.mark.parametrize("arch,keys,match", [
    ("qwen3moe", dict(expert_weights_norm=False), "qwen3moe.expert_weights_norm=False"),
    ("qwen3moe", dict(expert_gating_func=2), "qwen3moe.expert_gating_func=2"),
    ("qwen3moe", dict(expert_shared_feed_forward_length=64), "qwen3moe.expert_shared_feed_forward_length"),
    ("qwen3moe", dict(expert_used_count=2), "qwen3moe.expert_count is missing"),
    ("llama", dict(expert_count=4, expert_used_count=2, expert_weights_scale=2.5), "llama.expert_weights_scale"),
    ("gemma2", {"attention.scale": 0.1}, "gemma2.attention.scale=0.1"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3},
     "gemma3.attention.sliding_window_pattern=3"),
    ("gemma3", {"rope.freq_base_swa": 5e4}, "gemma3.rope.freq_base_swa"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "gemma3.attn_logit_softcapping"),
    ("qwen3", dict(attn_logit_softcapping=50.0), "qwen3.attn_logit_softcapping"),
])
def test_what_llama_cpp_would_run_differently_is_refused_by_name(arch, keys, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        config_from_gguf(_meta(arch, **keys), "x", TENSORS)


def test_per_expert_tensors_are_refused():
    with pytest.raises(ValueError, match="one tensor per expert"):
        config_from_gguf(_meta("llama", expert_count=4, expert_used_count=2), "m",
                         TENSORS | {"blk.0.ffn_gate.0.weight"})


def test_a_sliding_window_pattern_that_agrees_is_read():
    pattern = [i % 6 != 5 for i in range(12)]
    for value in (6, pattern):
        config = config_from_gguf(_meta("gemma3", block_count=12, **{
            "attention.sliding_window": 8, "attention.sliding_window_pattern": value}), "g", TENSORS)
        assert [k == "sliding_attention" for k in config.layer_kinds] == pattern


@pytest.mark.extended
def test_engine_serves_transformers_greedy_tokens_from_a_mixtral_gguf(tmp_path):
    from engine import LLM, SamplingParams

    hf_config, hf_params = load_hf_folder(FIXTURES / "mixtral", progress=False)
    path = tmp_path / "mixtral.gguf"
    write_gguf(path, hf_config, hf_params)
    llm = LLM(str(path), tokenizer=str(FIXTURES / "mixtral"), max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, num_kv_blocks=40, block_size=4, token_buckets=(16,), seq_buckets=(4,),
              prompt_scoring_bucket=False)
    outs = llm.generate([list(p) for p in REFERENCE["prompts"]],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == REFERENCE["greedy"]["mixtral"]
