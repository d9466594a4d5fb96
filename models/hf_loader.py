"""Hugging Face folders: config.json plus model.safetensors or a sharded index.

Tensors are read shard by shard with safetensors' numpy reader (memory-mapped), mapped to our
layout by `models.weights.layer_from_matrices`, and cast to the requested dtype.
"""

from __future__ import annotations

import json
import os

import numpy as np
from tqdm.auto import tqdm

from models.families import FAMILIES
from models.hf_config import read_hf_config
from models.weights import layer_from_matrices, to_device


def safetensors_files(folder: str) -> dict[str, str]:
    """Tensor name -> shard path, from model.safetensors.index.json or the lone shard(s)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors files in the model folder")
    from safetensors import safe_open

    mapping = {}
    for shard in shards:
        path = os.path.join(folder, shard)
        try:
            with safe_open(path, framework="np") as f:
                mapping.update(dict.fromkeys(f.keys(), path))
        except Exception as e:
            raise ValueError(f"{path}: corrupted or truncated safetensors file ({e})") from None
    return mapping


def load_hf_folder(folder: str | os.PathLike, *, dtype: str = "float32", progress: bool = True,
              host: bool = False):
    """Returns (ModelConfig, params) from a HF checkpoint folder."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such model folder")
    config = read_hf_config(folder)
    locations = safetensors_files(folder)
    by_shard: dict[str, list[str]] = {}
    for name, path in locations.items():
        by_shard.setdefault(path, []).append(name)
    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(total=len(locations), desc=f"loading {os.path.basename(folder)}", unit="tensor",
               disable=not progress, leave=False)
    for path, names in by_shard.items():
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: shard named in the index is missing")
        try:
            with safe_open(path, framework="np") as f:
                for name in names:
                    tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
                    bar.update(1)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"{path}: corrupted or truncated safetensors file ({e})") from None
    bar.close()

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{folder}: missing tensor {name}")
        return tensors[name]

    used = {"model.embed_tokens.weight", "model.norm.weight"}
    family = FAMILIES[config.architecture]
    layers = []
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        m = {ours: tensors[prefix + hf] for hf, ours in family.tensors.items() if prefix + hf in tensors}
        if not config.attention_bias:
            m = {k: v for k, v in m.items() if not k.endswith("_bias")}
        used.update(prefix + hf for hf, ours in family.tensors.items() if ours in m)
        if family.experts is not None:
            m.update(_experts(tensors, prefix, family.experts, config.num_experts, used, folder))
        layers.append(to_device(layer_from_matrices(config, m, f"{folder}: layer {i}"), dtype, host=host))
    params = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    embed_shape = (config.vocab_size, config.hidden_size)
    if params["embed"].shape != embed_shape:
        raise ValueError(f"{folder}: model.embed_tokens.weight has shape {params['embed'].shape}, "
                         f"expected {embed_shape} (vocab_size, hidden_size)")
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise ValueError(f"{folder}: config.json says tie_word_embeddings=false but there is no "
                             "lm_head.weight tensor")
        params["lm_head"] = get("lm_head.weight").T
        used.add("lm_head.weight")
    elif "lm_head.weight" in tensors:
        # transformers ties the head to the embedding and ignores a saved copy: one that differs
        # means the config and the tensors disagree about the model.
        if not np.array_equal(tensors["lm_head.weight"], params["embed"]):
            raise ValueError(f"{folder}: config.json says tie_word_embeddings=true but lm_head.weight "
                             "differs from model.embed_tokens.weight")
        used.add("lm_head.weight")
    # Older checkpoints save RoPE's inverse frequencies; they are recomputed from the config.
    left = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{folder}: tensor {left[0]} is not used by the {config.architecture} "
                         f"config ({len(left)} unused tensor(s)); the config and the weights disagree")
    params = to_device(params, dtype, host=host)
    params["layers"] = layers
    return config, params


def _experts(tensors: dict, prefix: str, spec: tuple, num_experts: int, used: set, folder: str) -> dict:
    """A layer's router and its per-expert matrices stacked [E, out, in] (Hugging Face saves one
    tensor per expert and projection)."""
    expert_prefix, names, router = spec
    out = {}
    if prefix + router in tensors:
        out["router"] = tensors[prefix + router]
        used.add(prefix + router)
    for hf, ours in names.items():
        mats = []
        for j in range(num_experts):
            name = prefix + expert_prefix.format(j=j) + hf
            if name not in tensors:
                raise ValueError(f"{folder}: missing tensor {name} (expert {j} of {num_experts})")
            mats.append(tensors[name])
            used.add(name)
        if len({m.shape for m in mats}) > 1:
            raise ValueError(f"{folder}: the experts' {hf} tensors of {prefix} differ in shape")
        out[f"experts_{ours}"] = np.stack(mats)
    return out
