"""A byte-level tokenizer for random-weight models, which come without a vocabulary.

Ids 0..255 are the UTF-8 bytes; 256 is BOS and 257 is EOS when the vocabulary has room (random
models of a real shape, e.g. `random:llama3-8b`, also take token-id prompts directly). It has the
interface of `text.tokenizer.Tokenizer`, including a small ChatML-like chat template. It has no
special tokens in text, so `encode_chat` is the plain rendering's bytes.
"""

from __future__ import annotations

from text.tokenizer_spec import PromptTooLongError

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bos_token_id = 256 if vocab_size > 257 else None
        self.eos_token_id = 257 if vocab_size > 257 else None
        self.eos_token_ids = frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})
        self.pad_token_id = self.eos_token_id
        self.add_bos_token = False
        self.chat_template = CHAT_TEMPLATE
        self.name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = True, *,
               max_num_tokens: int | None = None) -> list[int]:
        data = text.encode("utf-8")
        if max_num_tokens is not None and len(data) > max_num_tokens:
            raise PromptTooLongError(len(data), max_num_tokens)
        return list(data)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(t) for t in token_ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
        template = ImmutableSandboxedEnvironment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    special_tokens_in_content: bool = False) -> list[int]:
        """The rendered chat's bytes; no text can become a special token here."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
