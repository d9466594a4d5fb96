"""LoRA at the model level (models/lora.py): the PEFT folder read and checked against the base
model, the paged forward with adapters in slots equal to the dense forward over merged weights
(W + scale * B A), last-position logits within 1e-4 in float32, over one ragged batch that
mixes the base model and two adapters (the CPU's masked form), and the three product forms
(gather, ragged, masked) equal to a per-token reference."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import preset_config
from models.llama import forward_dense, forward_paged
from models.lora import (
    LORA_METHODS,
    LoRAError,
    allocate_lora_buffers,
    load_peft_adapter,
    lora_delta,
    merge_lora,
    write_slot,
)
from models.random_weights import random_params
from models.served_layout import fuse_projections
from tests.models.lora_files import adapter_tensors, write_adapter
from tests.models.paged_batch import Batch, make_batch

CONFIG = preset_config("tiny")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRABatch(Batch):
    lora_slots: object = None


def test_layout_and_scale(tmp_path):
    path = write_adapter(tmp_path / "a", CONFIG, rank=3, alpha=6, targets=ALL, seed=1)
    w = load_peft_adapter(path, CONFIG, max_lora_rank=8)
    assert (w.rank, w.scale) == (3, 2.0)
    raw = adapter_tensors(CONFIG, rank=3, targets=ALL, seed=1)
    key = "base_model.model.model.layers.1.self_attn.{}.lora_{}.weight"
    q, kv = CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim
    a, b = w.a["qkv_proj"][1], w.b["qkv_proj"][1]  # [3 * 8, e], [q + 2kv, 8]
    assert a.shape == (24, CONFIG.hidden_size) and b.shape == (q + 2 * kv, 8)
    np.testing.assert_array_equal(a[8:11], raw[key.format("k_proj", "A")])
    assert not a[11:16].any() and not b[:, 3:].any()  # zero padding up to max_lora_rank
    np.testing.assert_allclose(b[q : q + kv, :3], 2.0 * raw[key.format("k_proj", "B")], rtol=1e-6)
    rs = load_peft_adapter(write_adapter(tmp_path / "rs", CONFIG, rank=4, alpha=6, rslora=True), CONFIG, 8)
    assert rs.scale == pytest.approx(6 / 2)  # alpha / sqrt(r)


def _expect_error(tmp_path, match, **kwargs):
    path = write_adapter(tmp_path / "bad", CONFIG, **kwargs)
    with pytest.raises(LoRAError, match=match):
        load_peft_adapter(path, CONFIG, max_lora_rank=8)


def test_refusals_name_the_tensor_or_field(tmp_path):
    good = adapter_tensors(CONFIG, rank=4, targets=("q_proj", "v_proj"), seed=0)
    bad_shape = dict(good)
    name = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    bad_shape[name] = np.zeros((7, 4), np.float32)
    _expect_error(tmp_path, r"model\.layers\.0\.self_attn\.v_proj\.lora_B\.weight has shape \[7, 4\]",
                  tensors=bad_shape)
    unknown = {**good, "base_model.model.model.layers.0.self_attn.qkv.lora_A.weight": np.zeros((4, 64), np.float32)}
    _expect_error(tmp_path, r"layers\.0\.self_attn\.qkv\.lora_A\.weight.*unknown module", tensors=unknown)
    head = {**good, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}
    _expect_error(tmp_path, r"lm_head\.lora_A\.weight", tensors=head)
    _expect_error(tmp_path, r"target_modules has 'embed_tokens'", targets=("q_proj", "embed_tokens"), tensors=good)
    _expect_error(tmp_path, r"r=16 exceeds max_lora_rank=8", rank=16)
    missing = {k: v for k, v in good.items() if k != name}
    _expect_error(tmp_path, r"layer 0 v_proj: lora_B\.weight is missing", tensors=missing)
    _expect_error(tmp_path, r"layer 5.*2 layers",
                  tensors={**good, name.replace("layers.0", "layers.5"): good[name],
                           name.replace("layers.0", "layers.5").replace("lora_B", "lora_A"): good[name.replace("lora_B", "lora_A")]})
    _expect_error(tmp_path, r"use_dora=True is not supported", extra_config={"use_dora": True})
    _expect_error(tmp_path, r"unknown field\(s\) mystery_knob", extra_config={"mystery_knob": 1})
    _expect_error(tmp_path, r"not in target_modules", targets=("q_proj",), tensors=good)
    os.remove(os.path.join(tmp_path / "bad", "adapter_model.safetensors"))
    with open(tmp_path / "bad" / "adapter_model.safetensors", "wb") as f:
        f.write(b"not a safetensors file")
    with open(tmp_path / "bad" / "adapter_config.json", "w") as f:
        json.dump({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, f)
    with pytest.raises(LoRAError, match="corrupted or not a safetensors file"):
        load_peft_adapter(tmp_path / "bad", CONFIG, 8)


def test_paged_forward_with_adapters_equals_merged_dense(tmp_path, fast_compile):
    """One ragged batch: a base row, a row with adapter 1 (every module, rank 3) and a row with
    adapter 2 (rsLoRA, q/v only, rank 8); each row's last logits equal the dense forward of its
    own merged model."""
    params = jax.tree.map(jnp.asarray, random_params(CONFIG, seed=3))
    adapters = [load_peft_adapter(write_adapter(tmp_path / "one", CONFIG, rank=3, alpha=5, targets=ALL, seed=4),
                                  CONFIG, 8),
                load_peft_adapter(write_adapter(tmp_path / "two", CONFIG, rank=8, alpha=16, rslora=True, seed=5),
                                  CONFIG, 8)]
    buffers = allocate_lora_buffers(CONFIG, 4, 8, jnp.float32)  # slots 0 (none) .. 3
    for slot, w in ((1, adapters[0]), (3, adapters[1])):
        buffers = write_slot(buffers, slot, {p: {"a": w.a[p], "b": w.b[p]} for p in buffers})
    served = {**fuse_projections(params), "lora": buffers}
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (9, 17, 5)]
    slots_of_row = [0, 1, 3]
    tables = [[1, 2], [3, 4], [5]]
    batch = make_batch([(s, 0) for s in seqs], tables, 16, pad_tokens=1, pad_seqs=1, max_blocks=2)
    token_slots = np.concatenate([np.full(len(s), slot) for s, slot in zip(seqs, slots_of_row)] + [[0]])
    batch = LoRABatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, lora_slots=jnp.asarray(token_slots, jnp.int32))
    cache = (jnp.zeros((CONFIG.num_layers, 8, 16, CONFIG.num_kv_heads, CONFIG.head_dim)),) * 2
    dense = jax.jit(lambda p, ids: forward_dense(p, CONFIG, ids))
    references = [params, merge_lora(params, CONFIG, adapters[0]), merge_lora(params, CONFIG, adapters[1])]
    expected = [np.asarray(dense(p, jnp.asarray(np.pad(s, (0, 32 - len(s))))))[len(s) - 1]
                for p, s in zip(references, seqs)]
    base_last = np.asarray(dense(params, jnp.asarray(np.pad(seqs[1], (0, 32 - len(seqs[1]))))))[len(seqs[1]) - 1]
    assert np.abs(expected[1] - base_last).max() > 0.1  # the adapter changes the logits
    for method in ("masked",):  # the CPU's form; every form's products: the next test (one compile each)
        step = jax.jit(lambda p, c, b, m=method: forward_paged(p, CONFIG, c, b, scan_layers=True, lora_method=m))
        _, logits = step(served, cache, batch)
        for row in range(3):
            np.testing.assert_allclose(np.asarray(logits[row]), expected[row], atol=1e-4, rtol=1e-4,
                                       err_msg=f"{method}, row {row}")


def test_the_three_product_forms_equal_a_per_token_reference():
    """lora_delta for gather, ragged and masked against numpy, token by token: fused segments
    (q/k/v), unsorted slots, the zero slot 0, a traced layer index; and over a rank bucket."""
    rng = np.random.default_rng(1)
    layers, slots, n_seg, rank, e = 2, 4, 3, 4, 16
    segments = ((0, 8), (8, 12), (12, 16))
    a = rng.normal(size=(layers, slots, n_seg * rank, e)).astype(np.float32)
    b = rng.normal(size=(layers, 16, slots, rank)).astype(np.float32)  # [L, out, s, R]
    a[:, 0], b[:, :, 0] = 0, 0
    x = rng.normal(size=(7, e)).astype(np.float32)
    token_slots = np.array([2, 0, 3, 2, 1, 0, 3], np.int32)
    def reference():  # per token: its slot's A, then each segment's B (layer 1)
        out = np.zeros((7, 16), np.float32)
        for t, s in enumerate(token_slots):
            u = a[1, s] @ x[t]
            for j, (start, end) in enumerate(segments):
                out[t, start:end] = b[1, start:end, s] @ u[j * rank : (j + 1) * rank]
        return out

    expected = reference()
    for method in LORA_METHODS:
        got = jax.jit(lambda x, a, b, s, layer, m=method: lora_delta(x, a, b, s, layer, segments, method=m))(
            x, a, b, token_slots, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=method)
    # A rank bucket of 2: exact when the tokens' adapters have nothing past column 2 of each
    # segment (slot 1 keeps its columns 2-3: no token of slot 1 in this step).
    for j in range(n_seg):
        a[:, 2:, j * rank + 2 : (j + 1) * rank] = 0
    token_slots[token_slots == 1] = 3
    expected = reference()
    for method in LORA_METHODS:
        got = jax.jit(lambda x, a, b, s, layer, m=method: lora_delta(x, a, b, s, layer, segments, method=m, rank=2))(
            x, a, b, token_slots, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=f"{method}, rank 2")
