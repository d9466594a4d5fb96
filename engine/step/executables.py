"""Compiled step programs saved with a manifest, and loaded instead of compiling.

`python -m experiments.aot --save_executables=DIR` writes each bucket's compiled step
(`jax.experimental.serialize_executable`) and `manifest.json`: the versions of jax, jaxlib and
the device compiler's plugin, the platform and device kind, the model's shapes, the knobs that
decide the programs (dtype, backend, layer loop, tensor parallelism, every RunnerShapes field)
and the buckets. A server started with `--load_executables=DIR` builds the same manifest from its
own configuration (`manifest`) and loads the programs only if every field agrees; the first field
that differs is a ValueError naming it and both values, so a stale or foreign folder is refused
instead of running a program built for other shapes.

The manifest lists every bucket the runner compiles (`RunnerShapes.all_buckets`: the plain
buckets and the scoring bucket when `prompt_scoring`). A speculative draft's own programs (a draft
model's runner, a draft head's chain) are not saved: an engine that loads a folder compiles them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pickle

from engine.step.buckets import Bucket, RunnerShapes
from models.config import ModelConfig

MANIFEST = "manifest.json"
_PLUGINS = {"tpu": "libtpu", "gpu": "jax-cuda12-plugin"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def manifest(*, platform: str, device_kind: str, model: ModelConfig, dtype: str,
             attention_backend: str, layer_loop: str, tensor_parallel_size: int,
             shapes: RunnerShapes, quantization: str | None = None, activation_rows: int | None = None,
             kv_cache_dtype: str = "auto", smoothing: float | None = None, rows_kernel: str = "jnp") -> dict:
    """What must be equal between the process that compiled and the one that loads."""
    plugin = _PLUGINS.get(platform)
    as_json = lambda x: json.loads(json.dumps(x, default=str))  # noqa: E731  (tuples -> lists)
    return as_json({
        "versions": {"jax": _version("jax"), "jaxlib": _version("jaxlib"),
                     **({plugin: _version(plugin)} if plugin else {})},
        "platform": platform, "device_kind": device_kind,
        "model": {k: v for k, v in dataclasses.asdict(model).items() if k != "name"},
        "knobs": {"dtype": dtype, "attention_backend": attention_backend, "layer_loop": layer_loop,
                  "tensor_parallel_size": tensor_parallel_size, "quantization": quantization,
                  "quantization_activation_rows": activation_rows, "kv_cache_dtype": kv_cache_dtype,
                  # (LoRA rank buckets only when set: LoRA does not load executables, and
                  # manifests written before rank buckets existed stay valid)
                  # (smoothing only when on: manifests written before it existed stay valid; a
                  # smoothed tied embedding carries its factors, models/quant.py input_scale)
                  **({"quantization_smoothing": smoothing} if smoothing is not None else {}),
                  # (the native rows kernel only when on: its custom call must be registered to load)
                  **({"rows_kernel": rows_kernel} if rows_kernel != "jnp" else {}),
                  **{k: v for k, v in dataclasses.asdict(shapes).items() if v or k != "lora_ranks"}},
        "buckets": [dataclasses.astuple(b)[: 3 if b.lora_rank is None else 4] for b in shapes.all_buckets()],
    })


def _file(bucket: Bucket) -> str:
    return f"step_T{bucket.padded_tokens}_S{bucket.padded_seqs}_L{bucket.padded_logits}.pkl"


def save_executables(folder: str, meta: dict, compiled: dict) -> None:
    """compiled: {Bucket: jax.stages.Compiled}."""
    from jax.experimental.serialize_executable import serialize

    os.makedirs(folder, exist_ok=True)
    for bucket, executable in compiled.items():
        with open(os.path.join(folder, _file(bucket)), "wb") as f:
            pickle.dump(serialize(executable), f)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(meta, f, indent=1)


def _differing(saved, expected, path: str = "") -> tuple[str, object, object] | None:
    if isinstance(saved, dict) and isinstance(expected, dict):
        for key in sorted(set(saved) | set(expected)):
            found = _differing(saved.get(key), expected.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    return None if saved == expected else (path, saved, expected)


def load_executables(folder: str, expected: dict, devices) -> dict:
    """{Bucket: a callable executable on `devices` (the replica's, in mesh order)} from `folder`,
    after checking its manifest."""
    from jax.experimental.serialize_executable import deserialize_and_load

    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no manifest; write the folder with "
                                "`python -m experiments.aot --save_executables=DIR`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    # Top-level keys beyond the expected ones are information (the target's name), not checked.
    diff = _differing({k: saved.get(k) for k in expected}, expected)
    if diff:
        field, theirs, ours = diff
        raise ValueError(f"{path}: the saved executables were built for {field}={theirs!r}, this "
                         f"engine has {field}={ours!r}; rebuild them with experiments.aot or "
                         "change the engine's configuration to match")
    out = {}
    for values in saved["buckets"]:
        bucket = Bucket(*values)
        with open(os.path.join(folder, _file(bucket)), "rb") as f:
            out[bucket] = deserialize_and_load(*pickle.load(f), execution_devices=list(devices))
    return out
