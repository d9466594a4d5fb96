"""encode(max_num_tokens=...): a longer text raises PromptTooLongError with its token count
(before the ids become a Python list); a text within the limit encodes exactly as without it."""

import pytest

from models.default_model import default_model_path
from text.byte_tokenizer import ByteTokenizer
from text.tokenizer import PromptTooLongError, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_limit_counts_like_encode(tok, add_special_tokens):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    assert tok.encode(text, add_special_tokens=add_special_tokens, max_num_tokens=len(ids)) == ids
    with pytest.raises(PromptTooLongError) as info:
        tok.encode(text, add_special_tokens=add_special_tokens, max_num_tokens=len(ids) - 1)
    assert info.value.num_tokens == len(ids) and info.value.max_num_tokens == len(ids) - 1
    assert isinstance(info.value, ValueError)


def test_byte_tokenizer_limit():
    tok = ByteTokenizer(256)
    assert tok.encode("héllo", max_num_tokens=6) == list("héllo".encode())
    with pytest.raises(PromptTooLongError) as info:
        tok.encode("héllo", max_num_tokens=5)
    assert info.value.num_tokens == 6
