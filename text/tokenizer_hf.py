"""Tokenizers from Hugging Face files: a folder, or a bare `tokenizer.json` / `tokenizer.model`.

1. The backend: `tokenizer.json` through `tokenizers` when present, else `tokenizer.model` through
   `sentencepiece`.
2. Around it, what the checkpoint says: `tokenizer_config.json` (bos/eos/pad/unk tokens,
   `add_bos_token`, `add_eos_token`, `chat_template`), else `special_tokens_map.json`; a
   `chat_template.jinja` file; `generation_config.json`'s `eos_token_id` (one id or a list).
3. When the config does not say whether BOS is added, a `tokenizer.json` answers through its own
   post-processor (Llama 3's adds `<|begin_of_text|>`), and a bare SentencePiece model adds it, as
   transformers' LlamaTokenizer does.
"""

import json
import os
import pathlib
from typing import Any

import sentencepiece
import tokenizers

from text.tokenizer_spec import END_OF_GENERATION_NAMES, TokenizerLoadError, TokenizerSpec

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerLoadError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as the configs write it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], folder: pathlib.Path | None) -> str | None:
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}], the "default" one is used
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def hf_tokenizer_spec(path: pathlib.Path) -> TokenizerSpec:
    """Load a HF tokenizer folder, or a bare tokenizer.json / tokenizer.model file."""
    folder = path if path.is_dir() else None
    if folder is not None:
        if (folder / "tokenizer.json").is_file():
            file = folder / "tokenizer.json"
        elif (folder / "tokenizer.model").is_file():
            file = folder / "tokenizer.model"
        else:
            raise TokenizerLoadError(f"{folder}: the folder has neither tokenizer.json nor tokenizer.model")
        config = _read_json(folder / "tokenizer_config.json")
        if config is None:
            config = _read_json(folder / "special_tokens_map.json") or {}
        generation = _read_json(folder / "generation_config.json") or {}
    else:
        file, config, generation = path, {}, {}
    if file.suffix == ".json":
        return _from_tokenizer_json(file, config, generation, folder)
    return _from_sentencepiece_model(file, config, generation, folder)


def _stop_ids(eos: int | None, generation: dict[str, Any], marked: list[int]) -> frozenset[int]:
    stop = {eos} if eos is not None else set()
    configured = generation.get("eos_token_id")
    if isinstance(configured, int):
        stop.add(configured)
    elif isinstance(configured, list):
        stop.update(i for i in configured if isinstance(i, int))
    stop.update(marked)
    return frozenset(stop)


def _from_tokenizer_json(
    file: pathlib.Path, config: dict, generation: dict, folder: pathlib.Path | None
) -> TokenizerSpec:
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable files
        raise TokenizerLoadError(f"{file}: not a readable tokenizer.json: {e}") from e
    special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}

    def lookup(key: str, fallback_names: tuple[str, ...] = ()) -> int | None:
        content = _token_content(config.get(key))
        if content is not None:
            return backend.token_to_id(content)
        if key not in config:
            for name in fallback_names:
                if name in special.values():
                    return backend.token_to_id(name)
        return None

    bos = lookup("bos_token", _BOS_NAMES)
    eos = lookup("eos_token", END_OF_GENERATION_NAMES)
    add_bos = config.get("add_bos_token")
    add_eos = config.get("add_eos_token")
    if add_bos is None or add_eos is None:
        # The checkpoint's post-processor decides: see what it adds around a plain word.
        with_special = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
        if add_bos is None:
            add_bos = bos is not None and with_special[:1] == [bos] and without[:1] != [bos]
        if add_eos is None:
            add_eos = eos is not None and with_special[-1:] == [eos] and without[-1:] != [eos]
    marked = [i for i, content in special.items() if content in END_OF_GENERATION_NAMES]
    return TokenizerSpec(
        backend=backend,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=_stop_ids(eos, generation, marked),
        pad_token_id=lookup("pad_token"),
        unk_token_id=lookup("unk_token"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(add_eos),
        chat_template=_chat_template(config, folder),
        special_token_ids=frozenset(special),
        source=str(folder or file),
    )


def _from_sentencepiece_model(
    file: pathlib.Path, config: dict, generation: dict, folder: pathlib.Path | None
) -> TokenizerSpec:
    backend = sentencepiece.SentencePieceProcessor()
    try:
        backend.LoadFromSerializedProto(file.read_bytes())
    except (RuntimeError, OSError) as e:
        raise TokenizerLoadError(f"{file}: not a readable SentencePiece model: {e}") from e
    size = backend.get_piece_size()

    def lookup(key: str, default: int) -> int | None:
        content = _token_content(config.get(key))
        if content is not None:
            token_id = backend.piece_to_id(content)  # the unk id when the piece is unknown
            return token_id if backend.id_to_piece(token_id) == content else None
        return default if default >= 0 else None

    eos = lookup("eos_token", backend.eos_id())
    special = [i for i in range(size) if backend.is_control(i) or backend.is_unknown(i)]
    marked = [i for i in special if backend.id_to_piece(i) in END_OF_GENERATION_NAMES]
    return TokenizerSpec(
        backend=backend,
        vocab_size=size,
        bos_token_id=lookup("bos_token", backend.bos_id()),
        eos_token_id=eos,
        eos_token_ids=_stop_ids(eos, generation, marked),
        pad_token_id=lookup("pad_token", backend.pad_id()),
        unk_token_id=lookup("unk_token", backend.unk_id()),
        add_bos_token=bool(config.get("add_bos_token", True)),
        add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=_chat_template(config, folder),
        special_token_ids=frozenset(special),
        source=str(folder or file),
    )


def check_path(path: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    return path
