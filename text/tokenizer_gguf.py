"""Tokenizers from a GGUF file's vocabulary (the `tokenizer.ggml.*` metadata).

1. `tokenizer.ggml.model` picks the kind: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
2. gpt2: a `tokenizers` BPE model is built from `tokens` + `merges`; the pre-tokenizer follows
   `tokenizer.ggml.pre` (the same split the model's Hugging Face tokenizer.json uses), ByteLevel
   maps bytes to the printable alphabet the vocabulary is written in, and control (type 3) /
   user-defined (type 4) tokens become added tokens, so they match when written in text.
3. llama: a SentencePiece BPE model proto is assembled from `tokens` + `scores` + `token_type`
   (llama.cpp treats these vocabularies as score-ranked BPE) and loaded by `sentencepiece`.
4. BOS/EOS/pad/unk ids, `add_bos_token`/`add_eos_token` and the chat template come from the same
   metadata; missing flags default as llama.cpp does (BOS for SentencePiece, none for BPE).
"""

import json
import os
from typing import Any

import sentencepiece
import tokenizers
from sentencepiece import sentencepiece_model_pb2

from text.gguf_file import GGUFFile
from text.tokenizer_spec import END_OF_GENERATION_NAMES, TokenizerLoadError, TokenizerSpec

# GGUF token types (llama.cpp's llama_token_type); SentencePiece numbers its piece types the same.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
_BYTE_LEVEL_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer steps, ignore_merges), as each family's
# tokenizer.json has them. smollm/starcoder split every digit apart, then apply the GPT-2 regex.
_PRE_TOKENIZERS: dict[str, tuple[dict | None, list[dict], bool]] = {
    "gpt2": (None, [_BYTE_LEVEL_GPT2], False),
    "default": (None, [_BYTE_LEVEL_GPT2], False),
    "smollm": (None, [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL_GPT2], False),
    "starcoder": (None, [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL_GPT2], False),
    "llama-bpe": (None, [_split(_LLAMA3_REGEX), _BYTE_LEVEL_ONLY], True),
    "llama3": (None, [_split(_LLAMA3_REGEX), _BYTE_LEVEL_ONLY], True),
    "qwen2": ({"type": "NFC"}, [_split(_QWEN2_REGEX), _BYTE_LEVEL_ONLY], False),
}


def _get(reader: GGUFFile, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _require(reader: GGUFFile, key: str, source: str) -> Any:
    value = _get(reader, key)
    if value is None:
        raise TokenizerLoadError(f"{source}: GGUF metadata has no {key!r}; it carries no tokenizer")
    return value


def _strings(reader: GGUFFile, key: str, source: str) -> list[str]:
    field = reader.fields.get(key)
    if field is None:
        raise TokenizerLoadError(f"{source}: GGUF metadata has no {key!r}; it carries no tokenizer")
    if field.item_type is None or not all(isinstance(s, str) for s in field.value):
        raise TokenizerLoadError(f"{source}: GGUF metadata {key!r} is not an array of strings")
    # A stray invalid byte in one token is replaced (text/gguf_file.py) rather than making the
    # whole vocabulary unreadable.
    return list(field.value)


def _optional_id(reader: GGUFFile, key: str) -> int | None:
    value = _get(reader, key)
    return None if value is None else int(value)


def gguf_tokenizer_spec(reader: GGUFFile, path: str | os.PathLike) -> TokenizerSpec:
    """Build the tokenizer described by an open GGUF file's metadata."""
    source = os.fspath(path)
    model = _require(reader, "tokenizer.ggml.model", source)
    tokens = _strings(reader, "tokenizer.ggml.tokens", source)
    token_types = _get(reader, "tokenizer.ggml.token_type")
    if token_types is None:
        token_types = [TOKEN_NORMAL] * len(tokens)
    token_types = [int(t) for t in token_types]
    if len(token_types) != len(tokens):
        raise TokenizerLoadError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        backend = _bpe_backend(reader, tokens, token_types, source)
        special = frozenset(i for i, t in enumerate(token_types) if t == TOKEN_CONTROL)
        default_add_bos = False
    elif model == "llama":
        backend = _sentencepiece_backend(reader, tokens, token_types, source)
        special = frozenset(
            i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        )
        default_add_bos = True
    else:
        raise TokenizerLoadError(
            f"{source}: unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2', 'llama')"
        )

    bos = _optional_id(reader, "tokenizer.ggml.bos_token_id")
    eos = _optional_id(reader, "tokenizer.ggml.eos_token_id")
    stop = {i for i in (eos,) if i is not None}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        marked = _optional_id(reader, key)
        if marked is not None:
            stop.add(marked)
    stop.update(
        i
        for i, (tok, t) in enumerate(zip(tokens, token_types))
        if t == TOKEN_CONTROL and tok in END_OF_GENERATION_NAMES
    )
    add_bos = _get(reader, "tokenizer.ggml.add_bos_token")
    add_eos = _get(reader, "tokenizer.ggml.add_eos_token")
    return TokenizerSpec(
        backend=backend,
        vocab_size=len(tokens),
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=frozenset(stop),
        pad_token_id=_optional_id(reader, "tokenizer.ggml.padding_token_id"),
        unk_token_id=_optional_id(reader, "tokenizer.ggml.unknown_token_id"),
        add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        add_eos_token=False if add_eos is None else bool(add_eos),
        chat_template=_get(reader, "tokenizer.chat_template"),
        special_token_ids=special,
        source=source,
    )


def _bpe_backend(
    reader: GGUFFile, tokens: list[str], token_types: list[int], source: str
) -> tokenizers.Tokenizer:
    pre = _get(reader, "tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerLoadError(
            f"{source}: unsupported tokenizer.ggml.pre {pre!r} for a BPE vocabulary "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    normalizer, steps, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = []
    for merge in _strings(reader, "tokenizer.ggml.merges", source):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise TokenizerLoadError(f"{source}: malformed BPE merge {merge!r} (no space)")
        merges.append([left, right])
    # First occurrence wins when a vocabulary repeats a string (the later id stays decodable only
    # if it is an added token, which carries its own id).
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t == TOKEN_CONTROL,
        }
        for i, (tok, t) in enumerate(zip(tokens, token_types))
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and vocab[tok] == i
    ]
    description = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(description))
    except Exception as e:  # tokenizers raises a bare Exception for inconsistent vocab/merges
        raise TokenizerLoadError(f"{source}: the BPE vocabulary is inconsistent: {e}") from e


def _sentencepiece_backend(
    reader: GGUFFile, tokens: list[str], token_types: list[int], source: str
) -> sentencepiece.SentencePieceProcessor:
    scores = _get(reader, "tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise TokenizerLoadError(
            f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    unk = _optional_id(reader, "tokenizer.ggml.unknown_token_id")
    types = list(token_types)
    if unk is not None and 0 <= unk < len(types):
        types[unk] = TOKEN_UNKNOWN
    if TOKEN_UNKNOWN not in types:
        raise TokenizerLoadError(f"{source}: the SentencePiece vocabulary has no unknown token")
    proto = sentencepiece_model_pb2.ModelProto()
    for tok, score, t in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece = tok
        piece.score = float(score)
        piece.type = t if TOKEN_NORMAL <= t <= TOKEN_BYTE else TOKEN_NORMAL
    trainer = proto.trainer_spec
    trainer.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = TOKEN_BYTE in types
    trainer.unk_id = types.index(TOKEN_UNKNOWN)
    trainer.unk_piece = tokens[trainer.unk_id]
    for name in ("bos", "eos", "pad"):
        key = "padding" if name == "pad" else name
        token_id = _optional_id(reader, f"tokenizer.ggml.{key}_token_id")
        valid = token_id is not None and 0 <= token_id < len(tokens) and token_id != trainer.unk_id
        setattr(trainer, f"{name}_id", token_id if valid else -1)
        if valid:
            setattr(trainer, f"{name}_piece", tokens[token_id])
    add_space_prefix = _get(reader, "tokenizer.ggml.add_space_prefix")
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto.SerializeToString())
    except (RuntimeError, OSError) as e:
        raise TokenizerLoadError(f"{source}: the SentencePiece vocabulary does not load: {e}") from e
    return processor
