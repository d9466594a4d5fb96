"""Loaders: GGUF (each tensor type, Q/K un-permutation), HF safetensors folders (sharded),
orbax round trips, random presets, and the errors bad files raise."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models.checkpoint import load_checkpoint, save_checkpoint
from models.config import preset_config
from models.gguf_loader import load_gguf
from models.hf_config import config_from_hf
from models.hf_loader import load_hf_folder
from models.llama import forward_dense
from models.loader import load_model
from models.quant import QuantizedWeight
from models.random_weights import random_params
from tests.models.gguf_writer import write_gguf

TINY = preset_config("tiny")
# Every weight's inner dimension is 256, the block size of the K-quants.
TINY_K = dataclasses.replace(TINY, vocab_size=64, hidden_size=256, intermediate_size=256,
                             num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


def _flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_types_load_to_what_the_file_decodes_to(tmp_path, tiny_params, qtype):
    path = tmp_path / "m.gguf"
    decoded = write_gguf(path, TINY, tiny_params, qtype)
    config, params, _ = load_gguf(path, progress=False)
    assert dataclasses.replace(config, name=TINY.name, rms_norm_eps=TINY.rms_norm_eps) == TINY
    assert abs(config.rms_norm_eps - TINY.rms_norm_eps) < 1e-9  # stored as float32
    e = TINY.hidden_size
    # q/k come back un-permuted: equal to the HF layout the file started from.
    hf_q = np.asarray(tiny_params["layers"][0]["wq"]).reshape(e, -1).T
    got_q = np.asarray(params["layers"][0]["wq"]).reshape(e, -1).T
    if qtype == Q.F32:
        for key, value in _flat(tiny_params).items():
            np.testing.assert_array_equal(_flat(params)[key], value, err_msg=key)
        np.testing.assert_array_equal(got_q, hf_q)
    else:
        np.testing.assert_allclose(got_q, hf_q, atol=0.3)  # quantization error only
        np.testing.assert_array_equal(np.asarray(params["layers"][1]["w_down"]),
                                      decoded["blk.1.ffn_down.weight"].T)
    ids = jnp.arange(12) % TINY.vocab_size
    a = forward_dense(params, config, ids)
    b = forward_dense(tiny_params, TINY, ids)
    if qtype == Q.F32:
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert np.isfinite(np.asarray(a)).all()


@pytest.mark.parametrize("qtype,block_bytes", [(Q.Q4_K, 144), (Q.Q6_K, 210)], ids=["Q4_K", "Q6_K"])
def test_gguf_k_quants(tmp_path, qtype, block_bytes):
    params = random_params(TINY_K, seed=0)
    rng = np.random.default_rng(0)
    rows = TINY_K.intermediate_size
    data = rng.integers(0, 256, (rows, block_bytes), dtype=np.uint8)
    # Keep the f16 scales finite and small: Q4_K starts with d, dmin; Q6_K ends with d.
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q4_K:
        data[:, 0:2] = scale
        data[:, 2:4] = scale
    else:
        data[:, -2:] = scale
    path = tmp_path / "k.gguf"
    decoded = write_gguf(path, TINY_K, params, raw={"blk.0.ffn_up.weight": (data, qtype)})
    _, loaded, _ = load_gguf(path, progress=False)
    np.testing.assert_array_equal(np.asarray(loaded["layers"][0]["w_up"]), decoded["blk.0.ffn_up.weight"].T)
    assert np.isfinite(np.asarray(loaded["layers"][0]["w_up"])).all()


def test_hf_sharded_folder_with_qwen2_bias(tmp_path):
    from safetensors.numpy import save_file

    config = preset_config("tiny-qwen2")
    params = random_params(config, seed=5)
    e = config.hidden_size
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
               "lm_head.weight": np.asarray(params["lm_head"]).T}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        g = lambda k, layer=layer: np.asarray(layer[k])
        tensors.update({
            p + "input_layernorm.weight": g("attn_norm"), p + "post_attention_layernorm.weight": g("mlp_norm"),
            p + "self_attn.q_proj.weight": g("wq").reshape(e, -1).T, p + "self_attn.k_proj.weight": g("wk").reshape(e, -1).T,
            p + "self_attn.v_proj.weight": g("wv").reshape(e, -1).T, p + "self_attn.o_proj.weight": g("wo").reshape(-1, e).T,
            p + "self_attn.q_proj.bias": g("bq").reshape(-1), p + "self_attn.k_proj.bias": g("bk").reshape(-1),
            p + "self_attn.v_proj.bias": g("bv").reshape(-1),
            p + "mlp.gate_proj.weight": g("w_gate").T, p + "mlp.up_proj.weight": g("w_up").T,
            p + "mlp.down_proj.weight": g("w_down").T,
        })
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": config.vocab_size, "hidden_size": e,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": 1024, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "tie_word_embeddings": False}))
    loaded_config, loaded = load_hf_folder(tmp_path, progress=False)
    assert loaded_config.attention_bias and not loaded_config.tie_word_embeddings
    for key, value in _flat(params).items():
        np.testing.assert_array_equal(_flat(loaded)[key], value, err_msg=key)


def test_orbax_round_trip_is_bit_identical(tmp_path, tiny_params):
    folder = tmp_path / "ckpt"
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params)
    save_checkpoint(folder, TINY, bf16, tokenizer_source=None)
    config, restored, tokenizer_source = load_checkpoint(folder)
    assert config == TINY and tokenizer_source is None
    for key, value in _flat(bf16).items():
        got = _flat(restored)[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert got.tobytes() == value.tobytes(), key


def test_gguf_conversion_cache_restores_the_same_weights(tmp_path, tiny_params):
    from text.tokenizer import load_tokenizer  # noqa: F401  (the loader needs it importable)

    path = tmp_path / "m.gguf"
    write_gguf(path, TINY, tiny_params)
    # A GGUF without a vocabulary: pass a tokenizer folder-less model via the byte tokenizer path.
    config, params, _ = load_gguf(path, progress=False)
    cache = tmp_path / "cache"
    from models.loader import _cache_folder

    folder = _cache_folder(str(cache), str(path), "float32")
    save_checkpoint(folder, config, params, tokenizer_source=str(path))
    restored_config, restored, source = load_checkpoint(folder)
    assert restored_config == config and source == str(path)
    for key, value in _flat(params).items():
        assert _flat(restored)[key].tobytes() == value.tobytes(), key


def test_random_presets_have_their_shapes():
    for name in ("tiny", "smollm2-135m", "llama3-8b"):
        config = preset_config(name)
        shapes = jax.eval_shape(lambda c=config: random_params(c, seed=0))
        assert shapes["embed"].shape == (config.vocab_size, config.hidden_size)
        assert len(shapes["layers"]) == config.num_layers
        assert shapes["layers"][0]["wk"].shape == (config.hidden_size, config.num_kv_heads, config.head_dim)
    assert preset_config("llama3-8b").num_params > 7.9e9
    a = load_model("random:tiny", seed=1, progress=False).params
    b = load_model("random:tiny", seed=1, progress=False).params
    c = load_model("random:tiny", seed=2, progress=False).params
    np.testing.assert_array_equal(a["embed"], b["embed"])
    assert not np.array_equal(a["embed"], c["embed"])


# ---- bad input: every error names the file and the problem -----------------------------------


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(missing), progress=False)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing, progress=False)


def test_truncated_gguf_is_named(tmp_path, tiny_params):
    path = tmp_path / "cut.gguf"
    write_gguf(path, TINY, tiny_params)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|corrupted)"):
        load_gguf(path, progress=False)


def test_corrupted_gguf_is_named(tmp_path, tiny_params):
    path = tmp_path / "bad.gguf"
    write_gguf(path, TINY, tiny_params)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGXX"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a GGUF file"):
        load_gguf(path, progress=False)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_gguf(garbage, progress=False)


def test_unsupported_architecture_is_named(tmp_path, tiny_params):
    path = tmp_path / "arch.gguf"
    write_gguf(path, TINY, tiny_params, arch="gpt2")
    with pytest.raises(ValueError, match=r"arch\.gguf.*unsupported architecture 'gpt2'"):
        load_gguf(path, progress=False)
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        config_from_hf({"model_type": "bert"})


def test_unsupported_tensor_type_is_named(tmp_path):
    params = random_params(TINY_K, seed=0)
    rows = TINY_K.intermediate_size
    data = np.zeros((rows, 256), np.uint8)  # I8: one byte per value
    path = tmp_path / "i8.gguf"
    write_gguf(path, TINY_K, params, raw={"blk.0.ffn_up.weight": (data, Q.I8)})
    with pytest.raises(ValueError, match=r"i8\.gguf.*blk\.0\.ffn_up\.weight.*unsupported type I8"):
        load_gguf(path, progress=False)


def test_hf_folder_problems_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_folder(tmp_path, progress=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_folder(tmp_path, progress=False)


def test_load_model_conversion_cache_round_trip(tmp_path, tiny_params):
    from models.default_model import default_model_path

    path = tmp_path / "m.gguf"
    write_gguf(path, TINY, tiny_params)
    cache = str(tmp_path / "cache")
    tok_path = str(default_model_path())
    first = load_model(str(path), cache_dir=cache, tokenizer=tok_path, progress=False)
    second = load_model(str(path), cache_dir=cache, progress=False)  # tokenizer from the snapshot
    assert not first.from_cache and second.from_cache
    for key, value in _flat(first.params).items():
        assert _flat(second.params)[key].tobytes() == value.tobytes(), key
    text = "Hello wörld 😀 <|im_start|>user\nhi<|im_end|>"
    a, b = first.tokenizer, second.tokenizer
    assert a.encode(text) == b.encode(text) and b.decode(b.encode(text), skip_special_tokens=False) == text
    assert (a.eos_token_ids, a.bos_token_id, a.chat_template) == (b.eos_token_ids, b.bos_token_id, b.chat_template)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_q8_0_tables_served_in_their_own_blocks_give_the_dequantized_logits(tmp_path, tied):
    """native_blocks=True keeps a Q8_0 token_embd (and output) as int8 values with one float32
    scale per 32 (no float copy): the values and scales are the file's bytes, dequantizing them
    is exactly gguf's decode, and the logits equal those of the dequantize-to-float load."""
    config = TINY if tied else dataclasses.replace(TINY, tie_word_embeddings=False)
    params = random_params(config, seed=4)
    path = tmp_path / "q8.gguf"
    decoded = write_gguf(path, config, params, Q.Q8_0)
    _, floats, _ = load_gguf(path, progress=False)
    got_config, native, _ = load_gguf(path, progress=False, native_blocks=True)
    tables = {"embed": "token_embd.weight"} if tied else {"embed": "token_embd.weight", "output_proj": "output.weight"}
    assert ("lm_head" in native) is False and ("output_proj" in native) == (not tied)
    for key, name in tables.items():
        w = native[key]
        assert isinstance(w, QuantizedWeight) and w.block == 32 and w.q.dtype == jnp.int8
        assert w.scale.shape == (config.vocab_size, config.hidden_size // 32) and w.scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(w.dequantize()), decoded[name])
    # the layers' Q8_0 matrices in their blocks too (tests/models/test_gguf_q4.py), the norms float
    assert all(isinstance(layer["down_proj"], QuantizedWeight) and layer["attn_norm"].dtype == jnp.float32
               for layer in native["layers"])
    ids = jnp.arange(12) % config.vocab_size
    want = forward_dense(floats, got_config, ids)
    np.testing.assert_allclose(np.asarray(forward_dense(native, got_config, ids)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
