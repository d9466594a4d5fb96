"""Loading tokenizers from every kind of file, and the errors for bad ones: HF folders and bare
tokenizer.json files, GGUF BPE vocabularies with each supported pre-tokenizer, missing, truncated and
corrupted files, and unsupported kinds."""

import json

import gguf
import numpy as np
import pytest
import tokenizers

from models.default_model import default_model_path
from text.chat_template import ChatTemplateError
from text.tokenizer import (
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
    open_gguf,
    tokenizer_from_gguf,
)

NUM_SMALL_VOCAB = 3000
TEXTS = ["Hello world 12345", "naïve café 日本 😀", "  def f(x):\n\treturn x\n", "<|im_start|>hi<|im_end|>"]


@pytest.fixture(scope="module")
def default_path():
    return default_model_path()


@pytest.fixture(scope="module")
def reader(default_path):
    return open_gguf(default_path)


@pytest.fixture(scope="module")
def tok(reader, default_path) -> Tokenizer:
    return tokenizer_from_gguf(reader, default_path)


@pytest.fixture(scope="module")
def small_vocab(reader):
    """The first 3000 entries of the default vocabulary (specials, the 256 bytes, early merges) and
    the merges among them: a consistent byte-level BPE vocabulary that is quick to write and read."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:NUM_SMALL_VOCAB]
    known = set(tokens)
    merges = [
        m
        for m in reader.fields["tokenizer.ggml.merges"].contents()
        if m.replace(" ", "") in known and all(part in known for part in m.split(" "))
    ]
    types = reader.fields["tokenizer.ggml.token_type"].contents()[:NUM_SMALL_VOCAB]
    return {"token_list": tokens, "token_merges": merges, "token_types": types}


def _write_gguf(path, small_vocab, with_tensor=False, **overrides):
    """A GGUF with a small BPE vocabulary and `overrides` applied (None leaves a key out)."""
    fields = {"tokenizer_model": "gpt2", "tokenizer_pre": "smollm", "bos_token_id": 1, "eos_token_id": 2}
    fields.update(small_vocab)
    fields.update(overrides)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        if value is not None:
            getattr(writer, f"add_{key}")(value)
    if with_tensor:
        writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- HF files ----------------------------------------------------------------------------------


def test_hf_folder_with_tokenizer_json(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": [{"name": "default", "template": tok.chat_template}, {"name": "x", "template": "?"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.eos_token_ids == frozenset({0, 2}) and loaded.vocab_size == 49152
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(tok.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    # A chat_template.jinja file beside the config wins, as in recent transformers.
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "<|im_start|>Hi"


def test_bos_inferred_from_the_post_processor(tok, tmp_path):
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.add_bos_token is True
    assert loaded.encode("Hi") == [1, *tok.encode("Hi")]
    assert loaded.encode("Hi", add_special_tokens=False) == tok.encode("Hi")


def test_bare_tokenizer_json(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    # Without a config, the end-of-turn special tokens are recognised by name; BOS is unknown.
    assert loaded.bos_token_id is None and loaded.add_bos_token is False
    assert loaded.eos_token_id == 2 and loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.chat_template is None
    assert loaded.encode(TEXTS[1]) == tok.encode(TEXTS[1])


# -- GGUF BPE pre-tokenizers -------------------------------------------------------------------


@pytest.mark.parametrize(
    "pre, words",
    [
        ("smollm", ["hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld"]),
        ("starcoder", ["hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld"]),
        ("gpt2", ["hello", "Ġ12345", "Ġworld"]),
        ("default", ["hello", "Ġ12345", "Ġworld"]),
        ("llama-bpe", ["hello", "Ġ", "123", "45", "Ġworld"]),
        ("llama3", ["hello", "Ġ", "123", "45", "Ġworld"]),
        ("qwen2", ["hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld"]),
    ],
)
def test_gguf_pre_tokenizers(small_vocab, tmp_path, pre, words):
    loaded = load_tokenizer(_write_gguf(tmp_path / f"{pre}.gguf", small_vocab, tokenizer_pre=pre))
    split = loaded.backend.pre_tokenizer.pre_tokenize_str("hello 12345 world")
    assert [w for w, _ in split] == words
    for text in TEXTS:
        assert loaded.decode(loaded.encode(text), skip_special_tokens=False) == text


def test_gguf_flags_and_stop_tokens(small_vocab, tmp_path):
    path = _write_gguf(
        tmp_path / "flags.gguf", small_vocab, add_bos_token=True, add_eos_token=True, eot_token_id=5
    )
    loaded = load_tokenizer(path)
    assert loaded.encode("Hi") == [1, *loaded.encode("Hi", add_special_tokens=False), 2]
    assert loaded.eos_token_ids == frozenset({0, 2, 5})


# -- bad input ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    path = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="nowhere/model.gguf"):
        load_tokenizer(path)


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=f"{tmp_path}.*neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)


def test_truncated_gguf(small_vocab, default_path, tmp_path):
    whole = _write_gguf(tmp_path / "whole.gguf", small_vocab, with_tensor=True).read_bytes()
    assert load_tokenizer(tmp_path / "whole.gguf").vocab_size == NUM_SMALL_VOCAB
    # Cut in the header, in the vocabulary, just before the tensor data, and in the tensor data.
    for size in (12, len(whole) // 4, len(whole) - 16384 - 100, len(whole) - 100):
        path = tmp_path / f"cut_{size}.gguf"
        path.write_bytes(whole[:size])
        with pytest.raises(
            TokenizerLoadError, match=f"{path}: truncated or corrupted GGUF file of {size} bytes"
        ):
            load_tokenizer(path)
    # The default model's file, cut inside its vocabulary.
    path = tmp_path / "default_cut.gguf"
    with open(default_path, "rb") as f:
        path.write_bytes(f.read(300_000))
    with pytest.raises(TokenizerLoadError, match=f"{path}: truncated or corrupted GGUF file"):
        load_tokenizer(path)


def test_corrupted_gguf(default_path, tmp_path):
    with open(default_path, "rb") as f:
        data = bytearray(f.read(4096))
    path = tmp_path / "bad_magic.gguf"
    path.write_bytes(b"GGML" + data[4:])
    with pytest.raises(TokenizerLoadError, match=f"{path}: not a GGUF file"):
        load_tokenizer(path)
    path = tmp_path / "bad_count.gguf"
    data[8:16] = b"\xff" * 8  # the tensor count
    path.write_bytes(data)
    with pytest.raises(TokenizerLoadError, match=f"{path}: truncated or corrupted"):
        load_tokenizer(path)


def test_unsupported_tokenizer_kinds(small_vocab, tmp_path):
    path = _write_gguf(tmp_path / "wordpiece.gguf", small_vocab, tokenizer_model="wordpiece")
    with pytest.raises(TokenizerLoadError, match=f"{path}: unsupported tokenizer.ggml.model 'wordpiece'"):
        load_tokenizer(path)
    path = _write_gguf(tmp_path / "pre.gguf", small_vocab, tokenizer_pre="no-such-pre")
    with pytest.raises(TokenizerLoadError, match=f"{path}: unsupported tokenizer.ggml.pre 'no-such-pre'"):
        load_tokenizer(path)
    path = _write_gguf(tmp_path / "none.gguf", small_vocab, tokenizer_model=None)
    with pytest.raises(TokenizerLoadError, match=f"{path}: GGUF metadata has no 'tokenizer.ggml.model'"):
        load_tokenizer(path)
    path = _write_gguf(tmp_path / "merges.gguf", small_vocab, token_merges=None)
    with pytest.raises(TokenizerLoadError, match=f"{path}: GGUF metadata has no 'tokenizer.ggml.merges'"):
        load_tokenizer(path)
    path = _write_gguf(tmp_path / "types.gguf", small_vocab, token_types=[1, 1, 3])
    with pytest.raises(TokenizerLoadError, match=f"{path}: tokenizer.ggml.token_type has 3 entries"):
        load_tokenizer(path)
    path = _write_gguf(tmp_path / "bos.gguf", small_vocab, bos_token_id=10**6)
    with pytest.raises(TokenizerLoadError, match=f"{path}: bos_token_id=1000000 is outside"):
        load_tokenizer(path)


def test_corrupted_hf_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerLoadError, match="tokenizer.json: not a readable tokenizer.json"):
        load_tokenizer(tmp_path)
    model = tmp_path / "sp" / "tokenizer.model"
    model.parent.mkdir()
    model.write_bytes(b"\x00\x01 not a protobuf \xff" * 10)
    with pytest.raises(TokenizerLoadError, match="tokenizer.model: not a readable SentencePiece model"):
        load_tokenizer(model.parent)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    with pytest.raises(TokenizerLoadError, match="weights.bin: unknown tokenizer file type"):
        load_tokenizer(other)


def test_corrupted_tokenizer_config(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)


def test_chat_template_errors(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ messages | tojson }} {{ strftime_now('%Y') | length }}"
    )
    loaded = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="chat template raised: first message must be from the user"):
        loaded.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert loaded.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}] 4'
    )
    # The sandbox keeps templates away from Python internals.
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
