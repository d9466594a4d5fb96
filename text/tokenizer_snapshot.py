"""A tokenizer saved beside converted weights, so an orbax checkpoint is self-contained and a
restore does not re-parse the original file (parsing a GGUF vocabulary takes seconds).

The snapshot is the backend in its own format (`tokenizer.json` for `tokenizers`,
`tokenizer.model` for SentencePiece) plus `tokenizer_snapshot.json` with everything else the
TokenizerSpec holds (special ids, BOS/EOS behaviour, chat template).
"""

from __future__ import annotations

import json
import os

import sentencepiece
import tokenizers

from text.tokenizer import Tokenizer
from text.tokenizer_spec import TokenizerSpec

SNAPSHOT = "tokenizer_snapshot.json"
_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def save_tokenizer_snapshot(tokenizer: Tokenizer, folder: str) -> None:
    spec = tokenizer._spec
    if isinstance(spec.backend, sentencepiece.SentencePieceProcessor):
        kind, name = "sentencepiece", "tokenizer.model"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(spec.backend.serialized_model_proto())
    else:
        kind, name = "tokenizers", "tokenizer.json"
        spec.backend.save(os.path.join(folder, name))
    meta = {
        "kind": kind, "file": name, "vocab_size": spec.vocab_size,
        **{k: getattr(spec, k) for k in _ID_FIELDS},
        "eos_token_ids": sorted(spec.eos_token_ids), "special_token_ids": sorted(spec.special_token_ids),
        "add_bos_token": spec.add_bos_token, "add_eos_token": spec.add_eos_token,
        "chat_template": spec.chat_template, "source": spec.source,
    }
    with open(os.path.join(folder, SNAPSHOT), "w") as f:
        json.dump(meta, f)


def has_tokenizer_snapshot(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, SNAPSHOT))


def load_tokenizer_snapshot(folder: str) -> Tokenizer:
    path = os.path.join(folder, SNAPSHOT)
    try:
        with open(path) as f:
            meta = json.load(f)
        backend_path = os.path.join(folder, meta["file"])
        if meta["kind"] == "sentencepiece":
            backend = sentencepiece.SentencePieceProcessor(model_file=backend_path)
        else:
            backend = tokenizers.Tokenizer.from_file(backend_path)
    except (OSError, KeyError, json.JSONDecodeError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot restore the tokenizer snapshot ({e})") from None
    return Tokenizer(TokenizerSpec(
        backend=backend, vocab_size=meta["vocab_size"], **{k: meta[k] for k in _ID_FIELDS},
        eos_token_ids=frozenset(meta["eos_token_ids"]), add_bos_token=meta["add_bos_token"],
        add_eos_token=meta["add_eos_token"], chat_template=meta["chat_template"],
        special_token_ids=frozenset(meta["special_token_ids"]), source=meta["source"]))
