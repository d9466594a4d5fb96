"""Writes PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors) with random
weights for a ModelConfig, as PEFT saves them, for tests (no peft or torch needed)."""

import json
import os

import numpy as np
from safetensors.numpy import save_file

from models.lora import TARGET_MODULES, module_shape


def adapter_tensors(config, *, rank, targets, seed, b_std=0.3, layers=None):
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers) if layers is None else layers:
        for module in targets:
            out, inp = module_shape(config, module)
            name = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module][2]}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 1 / np.sqrt(inp), (rank, inp)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, b_std, (out, rank)).astype(np.float32)
    return tensors


def write_adapter(folder, config, *, rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=0, rslora=False,
                  b_std=0.3, layers=None, tensors=None, extra_config=None):
    """The folder's path; `tensors` replaces the random ones, `extra_config` adds config keys."""
    os.makedirs(folder, exist_ok=True)
    if tensors is None:
        tensors = adapter_tensors(config, rank=rank, targets=targets, seed=seed, b_std=b_std, layers=layers)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "use_rslora": rslora, "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
           "modules_to_save": None, "task_type": "CAUSAL_LM", "base_model_name_or_path": "random:tiny",
           "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
           "layers_to_transform": None, "layers_pattern": None, **(extra_config or {})}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)
