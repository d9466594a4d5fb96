"""llguidance's view of one of our tokenizers: the bytes of every token id and the EOS ids.

- A `tokenizers` backend (tokenizer.json, or a GGUF vocabulary rebuilt as one; text/): llguidance
  reads the same JSON (`LLTokenizer(backend.to_str())`), so its token bytes are exactly ours.
- SentencePiece and the byte tokenizer of random models: a `TokenizerWrapper`-shaped object with
  each id's bytes (a SentencePiece piece with "\u2581" as a space and "<0xAB>" as that byte;
  control tokens are special and have no bytes).
`n_vocab` is the sampled vocabulary (the model's logits may be cut to the tokenizer's size), and
every id in `eos_token_ids` ends a grammar that accepts. A vocabulary without an EOS (random
models' 256 bytes) gets a virtual one at id `vocab_size`: llguidance needs one, its mask bit is
dropped (the mask rows are wider by a word then, see masks.py), and such a grammar ends when it
is complete (the engine stops it) rather than by sampling EOS.
"""

from __future__ import annotations

import re

import llguidance

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _VocabWrapper:
    """What `llguidance.LLTokenizer` reads from a Python tokenizer (see llguidance.TokenizerWrapper)."""

    def __init__(self, tokens: list[bytes], eos_token_id: int, bos_token_id: int | None,
                 special_token_ids: list[int], encode):
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.special_token_ids = special_token_ids
        self.is_tokenizer_wrapper = True
        self._encode = encode

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def _sentencepiece_tokens(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    tokens, special = [], []
    for i in range(vocab_size):
        if i in tokenizer.special_token_ids:
            tokens.append(b"")
            special.append(i)
            continue
        piece = tokenizer.id_to_piece(i)
        byte = _BYTE_PIECE.fullmatch(piece)
        tokens.append(bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8"))
    return tokens, special


def _byte_tokens(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
    return tokens, list(range(256, vocab_size))


def build_ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer over ids [0, vocab_size) of `tokenizer` (text.Tokenizer or
    ByteTokenizer), plus a virtual EOS at vocab_size when it has none."""
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    eos = [e for e in eos if e < vocab_size]
    if not eos:
        tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)] + [b""]
        if hasattr(tokenizer, "id_to_piece"):
            tokens[:vocab_size], _ = _sentencepiece_tokens(tokenizer, vocab_size)
        wrapper = _VocabWrapper(tokens, vocab_size, None, [vocab_size],
                                lambda text: tokenizer.encode(text, add_special_tokens=False))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size + 1, eos_token=vocab_size)
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "id_to_piece"):
        tokens, special = _sentencepiece_tokens(tokenizer, vocab_size)
    else:
        tokens, special = _byte_tokens(tokenizer, vocab_size)
    wrapper = _VocabWrapper(tokens, eos[0], getattr(tokenizer, "bos_token_id", None), special,
                            lambda text: tokenizer.encode(text, add_special_tokens=False))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
