"""Orbax save/restore of converted parameters, so a second start skips dequantization.

A jaxserve checkpoint folder holds `jaxserve_model.json` (the ModelConfig and where the tokenizer
comes from) and `params/` (an orbax StandardCheckpointer tree). Restores are bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from models.config import ModelConfig, RopeScaling

MARKER = "jaxserve_model.json"


def is_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def save_checkpoint(folder: str | os.PathLike, config: ModelConfig, params: dict,
                    tokenizer_source: str | None) -> None:
    import orbax.checkpoint as ocp

    folder = os.path.abspath(os.fspath(folder))
    os.makedirs(folder, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(folder, "params"), params, force=True)
    checkpointer.wait_until_finished()
    meta = {"config": dataclasses.asdict(config), "tokenizer": tokenizer_source, "format": 1}
    tmp = os.path.join(folder, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(folder, MARKER))  # the marker appears only once params are whole


def load_checkpoint(folder: str | os.PathLike, *, dtype: str | None = None):
    """Returns (ModelConfig, params, tokenizer_source)."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(os.fspath(folder))
    marker = os.path.join(folder, MARKER)
    try:
        with open(marker) as f:
            meta = json.load(f)
        cfg = dict(meta["config"])
    except FileNotFoundError:
        raise FileNotFoundError(f"{marker}: not a jaxserve checkpoint folder") from None
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{marker}: corrupted checkpoint metadata ({e})") from None
    if cfg.get("rope_scaling"):
        cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
    config = ModelConfig(**cfg)
    try:
        params = ocp.StandardCheckpointer().restore(os.path.join(folder, "params"))
    except Exception as e:
        raise ValueError(f"{folder}/params: cannot restore orbax checkpoint ({e})") from None
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype), params)
    return config, params, meta.get("tokenizer")
