"""Tokenizers: one `Tokenizer` class over `tokenizers` (BPE, tokenizer.json) or `sentencepiece`.

1. `load_tokenizer(path)` takes a .gguf file, a Hugging Face folder, or a bare tokenizer.json /
   tokenizer.model; `tokenizer_from_gguf(reader, path)` serves the GGUF model loader, which has the
   file open already. Either way a loader builds a `TokenizerSpec` (backend + what the checkpoint
   says about BOS/EOS/pad, stop tokens and the chat template) and `Tokenizer` wraps it.
2. `encode` tokenizes the text as is (special tokens written in it, like "<|im_start|>", map to
   their ids) and adds BOS/EOS iff the checkpoint says so and `add_special_tokens` is true. A prompt
   rendered by `apply_chat_template` usually carries its own BOS: encode it with
   `add_special_tokens=False`.
3. `decode` turns ids back into text, dropping special (control) tokens unless asked to keep them;
   streaming goes through `IncrementalDetokenizer` (text/detokenizer.py).
4. `apply_chat_template` renders the checkpoint's Jinja template (text/chat_template.py);
   `encode_chat` renders and encodes it so that text inside a message never becomes a special
   token (only the template's own special tokens are special), unless the caller trusts it.
5. Encoding releases the GIL (the `tokenizers` batch path), so a server can tokenize a large
   prompt on a worker thread while its event loop keeps answering.
"""

import os
import pathlib
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sentencepiece
import tokenizers

from text.chat_template import (
    ChatContentError,
    compile_chat_template,
    render_chat_pieces,
    render_chat_template,
    validate_messages,
)
from text.detokenizer import IncrementalDetokenizer
from text.gguf_file import MAGIC as _GGUF_MAGIC
from text.gguf_file import GGUFFile, GGUFFormatError
from text.tokenizer_gguf import gguf_tokenizer_spec
from text.tokenizer_hf import check_path, hf_tokenizer_spec
from text.tokenizer_spec import PromptTooLongError, TokenizerLoadError, TokenizerSpec

__all__ = [
    "IncrementalDetokenizer",
    "PromptTooLongError",
    "Tokenizer",
    "TokenizerLoadError",
    "load_tokenizer",
    "tokenizer_from_gguf",
]


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its special tokens and chat template."""

    def __init__(self, spec: TokenizerSpec):
        self._spec = spec
        self._backend = spec.backend
        self._is_sentencepiece = isinstance(spec.backend, sentencepiece.SentencePieceProcessor)
        self.vocab_size: int = spec.vocab_size
        self.bos_token_id: int | None = spec.bos_token_id
        self.eos_token_id: int | None = spec.eos_token_id
        self.eos_token_ids: frozenset[int] = spec.eos_token_ids
        self.pad_token_id: int | None = spec.pad_token_id
        self.unk_token_id: int | None = spec.unk_token_id
        self.add_bos_token: bool = spec.add_bos_token
        self.add_eos_token: bool = spec.add_eos_token
        self.chat_template: str | None = spec.chat_template
        self.special_token_ids: frozenset[int] = spec.special_token_ids
        self._compiled_template = None
        self._plain_backend = None  # the tokenizers backend with special tokens read as text
        self._plain_lock = threading.Lock()
        if self._is_sentencepiece:
            self._init_sentencepiece()
        names = sorted((self.id_to_piece(i) for i in self.special_token_ids), key=len, reverse=True)
        names = [n for n in names if n]
        # Any special token's text, to spot it inside chat content.
        self._special_text = re.compile("|".join(re.escape(n) for n in names)) if names else None

    def _init_sentencepiece(self) -> None:
        # SentencePiece reads control tokens written in text as plain characters; split them out.
        names = sorted(
            (self._backend.id_to_piece(i) for i in self.special_token_ids), key=len, reverse=True
        )
        self._special_by_name = {self._backend.id_to_piece(i): i for i in self.special_token_ids}
        self._special_pattern = (
            re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None
        )

    @property
    def backend(self) -> tokenizers.Tokenizer | sentencepiece.SentencePieceProcessor:
        """The underlying `tokenizers.Tokenizer` or `SentencePieceProcessor` (for offsets, saving...)."""
        return self._backend

    def __repr__(self) -> str:
        kind = "sentencepiece" if self._is_sentencepiece else "tokenizers"
        return (
            f"Tokenizer({self._spec.source!r}, {kind}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id}, add_bos={self.add_bos_token})"
        )

    # -- text -> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, *,
               max_num_tokens: int | None = None) -> list[int]:
        """With `max_num_tokens`, a longer result raises PromptTooLongError before its ids
        become a Python list (for a huge text, building and freeing that list is what holds
        the GIL longest)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        num_added = 0
        if add_special_tokens:
            num_added = int(self.add_bos_token and self.bos_token_id is not None) + int(
                self.add_eos_token and self.eos_token_id is not None)
        limit = None if max_num_tokens is None else max_num_tokens - num_added
        if self._is_sentencepiece:
            ids = self._encode_sentencepiece(text)
            if limit is not None and len(ids) > limit:
                raise PromptTooLongError(len(ids) + num_added, max_num_tokens)
        else:
            ids = _encode_unlocked(self._backend, text, limit, num_added)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token names read as ordinary text (no BOS/EOS added)."""
        if self._is_sentencepiece:
            return self._backend.encode(text)  # SentencePiece itself never matches control tokens
        if self._plain_backend is None:
            with self._plain_lock:
                if self._plain_backend is None:
                    plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
                    plain.encode_special_tokens = True
                    self._plain_backend = plain
        return _encode_unlocked(self._plain_backend, text)

    def _encode_sentencepiece(self, text: str) -> list[int]:
        if self._special_pattern is None:
            return self._backend.encode(text)
        ids: list[int] = []
        # With a capturing group, split() alternates plain text (even) and special tokens (odd).
        for k, part in enumerate(self._special_pattern.split(text)):
            if k % 2:
                ids.append(self._special_by_name[part])
            elif part:
                ids.extend(self._backend.encode(part))
        return ids

    # -- ids -> text ---------------------------------------------------------------------------

    def _check_ids(self, token_ids: Iterable[Any]) -> list[int]:
        ids = [int(i) for i in token_ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = self._check_ids(token_ids)
        if not self._is_sentencepiece:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            return self._backend.decode([i for i in ids if i not in self.special_token_ids])
        # Text between special tokens was encoded segment by segment, each with its own dummy-prefix
        # space (as llama.cpp does); decoding segment by segment drops each again, so text round-trips.
        parts: list[str] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is not None and i not in self.special_token_ids:
                run.append(i)
                continue
            if run:
                parts.append(self._backend.decode(run))
                run = []
            if i is not None:
                parts.append(self._backend.id_to_piece(i))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for one id, as the model writes it (e.g. "Ġworld", "▁world")."""
        (token_id,) = self._check_ids([token_id])
        if self._is_sentencepiece:
            return self._backend.id_to_piece(token_id)
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} has no vocabulary entry")
        return piece

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        return [self.id_to_piece(i) for i in token_ids]

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry (or special token), None if there is none."""
        if self._is_sentencepiece:
            token_id = self._backend.piece_to_id(piece)
            return token_id if self._backend.id_to_piece(token_id) == piece else None
        return self._backend.token_to_id(piece)

    # -- chat ----------------------------------------------------------------------------------

    def _special_token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_piece(token_id)

    def _template_specials(self) -> dict[str, str]:
        return {
            "bos_token": self._special_token_text(self.bos_token_id),
            "eos_token": self._special_token_text(self.eos_token_id),
            "pad_token": self._special_token_text(self.pad_token_id),
            "unk_token": self._special_token_text(self.unk_token_id),
        }

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the checkpoint's template; extra kwargs become template variables."""
        validate_messages(messages)
        if self.chat_template is None:
            raise ValueError(
                f"{self._spec.source}: the checkpoint has no chat template; "
                "encode a plain prompt instead of chat messages"
            )
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        return render_chat_template(
            self._compiled_template, messages, add_generation_prompt, self._template_specials(), **kwargs
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """The chat prompt's ids (the template writes its own BOS). Text inside a message's
        content is never read as a special token, unless `special_tokens_in_content` (trusted
        callers). A template that transforms contents, with a content that spells a special
        token, raises ChatContentError (it cannot be encoded safely)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if special_tokens_in_content or self._special_text is None:
            return self.encode(text, add_special_tokens=False)
        spelled = [i for i, m in enumerate(messages) if self._special_text.search(m["content"])]
        if not spelled:  # the common case: the plain encoding is already safe
            return self.encode(text, add_special_tokens=False)
        pieces = render_chat_pieces(self._compiled_template, messages, add_generation_prompt,
                                    self._template_specials(), text, **kwargs)
        if pieces is None:
            i = spelled[0]
            found = self._special_text.search(messages[i]["content"]).group(0)
            raise ChatContentError(
                f"messages[{i}].content",
                f"messages[{i}].content contains the special token text {found!r}, and this chat "
                "template does not copy contents verbatim, so it cannot be kept as plain text")
        ids: list[int] = []
        for piece, is_content in pieces:
            ids.extend(self.encode_plain(piece) if is_content else self.encode(piece, add_special_tokens=False))
        return ids


def _encode_unlocked(backend: tokenizers.Tokenizer, text: str, limit: int | None = None,
                     num_added: int = 0) -> list[int]:
    # The batch entry points release the GIL (encode() holds it for the whole call); _fast skips
    # the character offsets, which nothing here uses. Same ids as encode(). len() of the
    # Encoding counts without building the ids list.
    encoding = backend.encode_batch_fast([text], add_special_tokens=False)[0]
    if limit is not None and len(encoding) > limit:
        raise PromptTooLongError(len(encoding) + num_added, limit + num_added)
    return encoding.ids


def tokenizer_from_gguf(reader: GGUFFile, path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored in an open GGUF file (`path` names it in errors)."""
    try:
        return Tokenizer(gguf_tokenizer_spec(reader, path))
    except TokenizerLoadError:
        raise
    except (IndexError, KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(
            f"{os.fspath(path)}: the GGUF tokenizer metadata is corrupted ({type(e).__name__}: {e})"
        ) from e


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed GGUF file at `path` (text/gguf_file.py), with errors that name the file and say
    what is wrong with it: FileNotFoundError, or TokenizerLoadError (a ValueError)."""
    path = check_path(path)
    if not path.is_file():
        raise TokenizerLoadError(f"{path}: expected a .gguf file, found a folder")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise TokenizerLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError) as e:
        raise TokenizerLoadError(
            f"{path}: truncated or corrupted GGUF file of {path.stat().st_size} bytes ({e})"
        ) from e


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A .gguf file, a HF folder (tokenizer.json, else tokenizer.model, + tokenizer_config.json),
    or a bare tokenizer.json / tokenizer.model file."""
    path = check_path(path)
    if path.is_dir() or path.suffix in (".json", ".model"):
        return Tokenizer(hf_tokenizer_spec(path))
    if path.suffix == ".gguf" or _starts_with_gguf_magic(path):
        return tokenizer_from_gguf(open_gguf(path), path)
    raise TokenizerLoadError(
        f"{path}: unknown tokenizer file type (expected .gguf, tokenizer.json, tokenizer.model "
        "or a folder with one of them)"
    )


def _starts_with_gguf_magic(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC
