"""What a tokenizer loader hands to `Tokenizer`: the backend plus what the checkpoint says around it.

Loaders (`tokenizer_gguf.py`, `tokenizer_hf.py`) build one of these; `tokenizer.Tokenizer` wraps it.
Keeping the record separate lets the loaders and the wrapper import it without importing each other.
The errors every tokenizer raises live here too.
"""

import dataclasses

import sentencepiece
import tokenizers

# Special tokens that end a turn or a document, by the names checkpoints give them. A token with one
# of these names that the checkpoint marks special (control) stops generation, as in llama.cpp.
END_OF_GENERATION_NAMES = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)


class PromptTooLongError(ValueError):
    """encode(max_num_tokens=...) found more tokens than allowed (`num_tokens` of them)."""

    def __init__(self, num_tokens: int, max_num_tokens: int):
        super().__init__(f"the text has {num_tokens} tokens, more than {max_num_tokens}")
        self.num_tokens = num_tokens
        self.max_num_tokens = max_num_tokens


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing a field, is truncated or corrupted, or has an unsupported kind."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    backend: tokenizers.Tokenizer | sentencepiece.SentencePieceProcessor
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    # Every id that ends generation: eos plus end-of-turn tokens the checkpoint marks.
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    # Ids dropped by decode(skip_special_tokens=True): control tokens (and unk for SentencePiece).
    special_token_ids: frozenset[int]
    # Where it came from, for error messages and repr.
    source: str

    def __post_init__(self):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise TokenizerLoadError(
                    f"{self.source}: {name}={value} is outside the vocabulary (size {self.vocab_size})"
                )
        bad = sorted(i for i in self.eos_token_ids if not 0 <= i < self.vocab_size)
        if bad:
            raise TokenizerLoadError(f"{self.source}: eos token ids {bad} are outside the vocabulary")
