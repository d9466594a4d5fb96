"""Incremental detokenization: text deltas for streamed tokens, never a broken UTF-8 character.

Decoding token by token does not work: one character may span several byte-level tokens, and
SentencePiece drops the leading space of whatever it decodes first. So each step decodes a short
window of recent ids twice, once up to `read_offset` (text already emitted) and once to the end,
and emits the difference. Invariants:

- `ids[prefix_offset:read_offset]` were already emitted and end on a character boundary, so their
  text is a prefix of the window's text and is subtracted by length.
- A delta ending in U+FFFD means the last character's bytes are not all here yet: nothing is
  emitted and the window grows until they are (or until `flush()` at the end of the request).
- Without a prompt, the deltas joined (after `flush()`) equal `tokenizer.decode(output_ids)`. With
  `prompt_token_ids`, the last few prompt ids are decoding context: the text is the continuation
  of the prompt's text, which is the same for byte-level BPE and keeps a SentencePiece word's
  leading space that a decode of the output alone would drop.
"""

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt ids kept as context: enough to cover a character split over several byte tokens.
_PROMPT_CONTEXT = 6


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the window ids[prefix_offset:] is kept; older ids can no longer change the text.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if prompt_token_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._parts: list[str] = []
        self._num_output_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas returned by add() and flush(), joined)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, complete: bool) -> str:
        seen = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(seen) :]
        if not complete and (not delta or delta.endswith(_REPLACEMENT)):
            return ""
        self._parts.append(delta)
        # The just-emitted ids become the next step's context; drop the ids before them.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta

    def add(self, token_ids: Sequence[int]) -> str:
        """Take newly generated ids; return the new text (possibly "", if a character is pending)."""
        self._ids.extend(int(i) for i in token_ids)
        self._num_output_tokens += len(token_ids)
        return self._advance(complete=False)

    def flush(self) -> str:
        """End of the request: emit whatever is pending, incomplete characters included (as U+FFFD)."""
        return self._advance(complete=True)
