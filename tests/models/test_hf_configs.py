"""Hugging Face configs in both formats, against transformers, and the strict reading of every field.

Fixtures (tests/fixtures/hf_tiny/, by scripts/make_hf_config_fixtures.py): five tiny random models
saved by transformers 5.24 (`rope_parameters`, no top-level `rope_theta`), each with the same
config as transformers 4.57 saves it (`config_v4.json`: `rope_theta` / `rope_scaling`), and
transformers' float32 logits and greedy tokens for three prompts.
"""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import RopeScaling
from models.gguf_config import _llama3_factors, config_from_gguf
from models.hf_config import config_from_hf, read_hf_config
from models.hf_loader import load_hf_folder
from models.llama import forward_dense

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf_tiny"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
NAMES = sorted(REFERENCE["models"])


@pytest.fixture(scope="module")
def reference_logits():
    with np.load(FIXTURES / "reference.npz") as f:
        return dict(f)


def _v4_folder(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """The same weights with the config transformers 4 writes."""
    folder = tmp_path / f"{name}_v4"
    folder.mkdir()
    shutil.copy(FIXTURES / name / "model.safetensors", folder)
    shutil.copy(FIXTURES / name / "config_v4.json", folder / "config.json")
    return folder


def _logits(params, config, prompt):
    return np.asarray(jax.jit(forward_dense, static_argnums=1)(params, config, jnp.asarray(prompt, jnp.int32)))


def test_transformers5_config_has_no_top_level_rope_theta():
    # The bug's precondition: what current transformers writes.
    config = json.loads((FIXTURES / "llama_theta5e5" / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 5e5


@pytest.mark.parametrize("name", NAMES)
def test_both_formats_read_to_one_config_and_match_transformers(tmp_path, name, reference_logits):
    folder4 = _v4_folder(tmp_path, name)
    v5 = read_hf_config(FIXTURES / name)
    assert dataclasses.replace(read_hf_config(folder4), name=v5.name) == v5
    config5, params5 = load_hf_folder(FIXTURES / name, progress=False)
    config4, params4 = load_hf_folder(folder4, progress=False)
    for i, prompt in enumerate(REFERENCE["prompts"]):
        got5 = _logits(params5, config5, prompt)
        got4 = _logits(params4, config4, prompt)
        np.testing.assert_array_equal(got4, got5)
        want = reference_logits[f"{name}/logits_{i}"]
        np.testing.assert_allclose(got5, want, atol=1e-4, rtol=0, err_msg=f"{name} prompt {i}")


def test_the_reported_model_reads_its_rope_and_head_dim():
    config = read_hf_config(FIXTURES / "llama_theta5e5")
    assert config.rope_theta == 5e5 and config.head_dim == 16 != config.hidden_size // config.num_heads
    scaled = read_hf_config(FIXTURES / "llama3_scaling")
    assert scaled.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert read_hf_config(FIXTURES / "mistral_window").sliding_window == 5
    assert read_hf_config(FIXTURES / "qwen2_bias").attention_bias


@pytest.mark.extended  # make test-extended (CI runs it after make test)
@pytest.mark.parametrize("name", ["llama_theta5e5", "mistral_window"])
def test_engine_serves_the_folder_with_transformers_greedy_tokens(name):
    from engine import LLM, SamplingParams

    llm = LLM(str(FIXTURES / name), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              num_kv_blocks=32, block_size=4, token_buckets=(4, 32), seq_buckets=(4,))
    outs = llm.generate([list(p) for p in REFERENCE["prompts"]],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == REFERENCE["greedy"][name]
    if name == "mistral_window":  # every layer slides (window 5): one cache over the sliding pool
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.sliding is not None and llm.engine.runner.kv_cache[0].shape[1] == kv.sliding.pool.num_blocks


# ---- refusals: each names the field and the value -------------------------------------------

def _v5(name="llama3_scaling", **changes):
    config = json.loads((FIXTURES / name / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "su"])
def test_unknown_rope_type_is_refused_by_name(rope_type):
    with pytest.raises(ValueError, match=rf"rope_parameters\.rope_type='{rope_type}'"):
        config_from_hf(_v5(rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4}))
    v4 = _v5(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=rf"rope_scaling\.rope_type='{rope_type}'"):
        config_from_hf(v4)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_unsupported_hidden_act_is_refused_by_name(act):
    with pytest.raises(ValueError, match=rf"hidden_act='{act}'"):
        config_from_hf(_v5(hidden_act=act))


@pytest.mark.parametrize(("changes", "field"), [
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(sliding_window=128), "sliding_window=128"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config='gptq'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architectures="),
    (dict(model_type=None), "model_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     "lacks 'low_freq_factor'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mscale": 2.0}),
     r"rope_parameters\.mscale=2\.0"),
    (dict(rope_theta=1e4), "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0 disagree"),
])
def test_fields_that_change_the_computation_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(_v5(**changes))


def test_qwen2_window_on_some_layers_only_is_refused():
    config = _v5("qwen2_bias", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                 layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="layer_types="):
        config_from_hf(config)
    every_layer = _v5("qwen2_bias", use_sliding_window=True, sliding_window=8, max_window_layers=0,
                      layer_types=["sliding_attention", "sliding_attention"])
    assert config_from_hf(every_layer).sliding_window == 8


def test_per_layer_type_rope_parameters():
    entry = {"rope_type": "default", "rope_theta": 1e6}
    config = _v5("qwen2_bias", rope_parameters={"full_attention": entry})
    assert config_from_hf(config).rope_theta == 1e6
    other = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    config = _v5("qwen2_bias", use_sliding_window=True, sliding_window=8, max_window_layers=0,
                 layer_types=["sliding_attention", "sliding_attention"],
                 rope_parameters={"full_attention": other, "sliding_attention": entry})
    assert config_from_hf(config).rope_scaling is None  # the entry of the kinds in use


def test_family_defaults_stand_in_for_omitted_fields():
    # transformers' own defaults, not ours: Mistral slides at 4096, RMSNorm eps 1e-6.
    config = _v5("mistral_window", sliding_window=None, rms_norm_eps=None)
    read = config_from_hf(config)
    assert read.sliding_window == 4096 and read.rms_norm_eps == 1e-6


def test_fields_that_do_not_change_the_computation_are_ignored(caplog):
    config = _v5(attention_dropout=0.3, initializer_range=1.0, use_cache=False, torch_dtype="bfloat16")
    assert config_from_hf(config) == config_from_hf(_v5())
    assert "unknown field" not in caplog.text
    with caplog.at_level("WARNING"):
        config_from_hf(_v5(new_knob=3))
    assert "new_knob" in caplog.text
    with pytest.raises(ValueError, match="unknown field.*new_knob"):
        config_from_hf(_v5(new_knob=3), strict_unknown=True)


def test_tensors_that_disagree_with_the_config_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    def folder_with(name, config, tensors):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    tied = load_file(str(FIXTURES / "llama3_scaling" / "model.safetensors"))
    other_head = dict(tied, **{"lm_head.weight": tied["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        load_hf_folder(folder_with("tied", _v5(), other_head), progress=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=false but there is no lm_head.weight"):
        load_hf_folder(folder_with("untied", _v5(tie_word_embeddings=False), tied), progress=False)
    o_bias = dict(tied, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)})
    with pytest.raises(ValueError, match="o_proj.bias is not used"):
        load_hf_folder(folder_with("bias", _v5(), o_bias), progress=False)


# ---- GGUF metadata --------------------------------------------------------------------------

_GGUF = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
         "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
         "llama.attention.head_count_kv": 2, "llama.context_length": 1024,
         "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 5e5,
         "llama.rope.dimension_count": 16, "llama.vocab_size": 256}


def _gguf(rope_freqs=None, **changes):
    meta = {**_GGUF, **{k.replace("__", "."): v for k, v in changes.items()}}
    names = {"token_embd.weight"} | ({"rope_freqs.weight"} if rope_freqs is not None else set())
    return config_from_gguf(meta, "t", names, rope_freqs=rope_freqs)


@pytest.mark.parametrize(("key", "value"), [
    ("llama.expert_shared_count", 2), ("llama.attention.layer_norm_epsilon", 1e-5),
    ("llama.attn_logit_softcapping", 50.0), ("llama.rope.scaling.attn_factor", 2.0),
    ("llama.rope.dimension_count", 8), ("llama.attention.value_length", 32),
    ("llama.rope.scaling.type", "yarn"), ("llama.logit_scale", 0.5), ("llama.brand_new_key", 1),
])
def test_gguf_keys_that_change_the_computation_are_refused(key, value):
    with pytest.raises(ValueError, match=key.split("llama.")[1].replace(".", r"\.")):
        _gguf(**{key.replace(".", "__"): value})


def test_gguf_required_keys_and_neutral_values():
    meta = dict(_GGUF)
    del meta["llama.attention.layer_norm_rms_epsilon"]
    with pytest.raises(ValueError, match="lacks 'llama.attention.layer_norm_rms_epsilon'"):
        config_from_gguf(meta, "t", set())
    assert _gguf(llama__expert_count=0, llama__rope__scaling__finetuned=True).rope_theta == 5e5
    assert _gguf(llama__attention__sliding_window=64).sliding_window == 64


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and Llama 3.2
def test_gguf_llama3_factor_is_read_from_rope_freqs(factor):
    inv_freq = 1.0 / (5e5 ** (np.arange(0, 16, 2) / 16))
    freqs = _llama3_factors(inv_freq, factor, 1.0, 4.0, 8192).astype(np.float32)
    assert _gguf(rope_freqs=freqs).rope_scaling == RopeScaling("llama3", factor, 1.0, 4.0, 8192)
    with pytest.raises(ValueError, match="rope_freqs.weight does not follow llama3"):
        _gguf(rope_freqs=np.linspace(1, factor, 8).astype(np.float32))
