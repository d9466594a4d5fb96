"""SentencePiece tokenizers: a tiny model trained here on generated text, loaded as a bare
tokenizer.model, from a llama-style GGUF vocabulary built from it, and from a HF folder."""

import json
import random

import gguf
import pytest
import sentencepiece

from text.tokenizer import IncrementalDetokenizer, load_tokenizer

SYLLABLES = ["ka", "to", "ri", "mon", "sel", "va", "qu", "ex", "ün", "çi", "lo", "pra", "dé", "ß"]
TEXTS = [
    "kato rimon selva",
    "  two spaces, then\ttab and\nnewline  ",
    "Punctuation! (brackets) [and] {braces}; 3.14 + 2 = 5.14?",
    "unseen characters fall back to bytes: Ω ж 日本 😀 👍🏽",
    "prados déçi ünlo",
    "",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _corpus(rng: random.Random, num_lines: int) -> str:
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(300)]
    words += ["the", "and", "of", "to", "tab", "two", "new", "line", "space", "back", "byte"]
    lines = []
    for _ in range(num_lines):
        line = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        lines.append(line + rng.choice([".", ",", "!", "?", ";", ""]) + rng.choice(["", " 42", " (x)"]))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A byte-fallback BPE SentencePiece model with Llama's settings (no normalization), trained on
    generated text; `<|im_end|>` is a control symbol, as chat models add theirs."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text(_corpus(random.Random(0), 3000), encoding="utf-8")
    with open(folder / "train.log", "w") as log:
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(folder / "tokenizer"),
            vocab_size=400,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            control_symbols=["<|im_end|>"],
            logstream=log,
        )
    return folder / "tokenizer.model"


@pytest.fixture(scope="module")
def sp(sp_model):
    return sentencepiece.SentencePieceProcessor(model_file=str(sp_model))


def _write_llama_gguf(path, sp, **extra):
    """A GGUF file holding only the tokenizer metadata of `sp`, the way llama.cpp writes Llama's."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bare_model_round_trips_and_matches_sentencepiece(sp_model, sp):
    tok = load_tokenizer(sp_model)
    assert tok.vocab_size == sp.get_piece_size() == 400
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.add_bos_token is True  # a bare SentencePiece model adds BOS, as LlamaTokenizer does
    end_of_turn = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == frozenset({2, end_of_turn})
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(text) == [1, *ids]
        assert tok.decode(tok.encode(text)) == text
    assert any(sp.is_byte(i) for i in tok.encode(TEXTS[3]))


def test_special_tokens_written_in_text(sp_model):
    tok = load_tokenizer(sp_model)
    end_of_turn = tok.token_to_id("<|im_end|>")
    text = "<s>kato<|im_end|>rimon</s>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and end_of_turn in ids
    # Each text segment gets its own dummy-prefix space ("▁rimon"), as in llama.cpp; keeping the
    # special tokens, decoding drops it again, so the text round-trips ...
    assert tok.decode(ids, skip_special_tokens=False) == text
    # ... while without them it separates the words, as in HF's and llama.cpp's decoders.
    assert tok.decode(ids) == "kato rimon"
    assert tok.convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]


def test_llama_gguf_vocabulary_encodes_like_the_original(sp_model, sp, tmp_path):
    path = _write_llama_gguf(tmp_path / "llama.gguf", sp, add_bos_token=False, chat_template=CHAT_TEMPLATE)
    tok = load_tokenizer(path)
    assert tok.vocab_size == 400 and tok.add_bos_token is False
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "kato"}])
    assert rendered == "<s>[user] kato<|im_end|>\n[assistant] "
    assert tok.encode(rendered, add_special_tokens=False)[:1] == [1]


def test_llama_gguf_defaults_to_adding_bos(sp, tmp_path):
    tok = load_tokenizer(_write_llama_gguf(tmp_path / "llama.gguf", sp))
    assert tok.add_bos_token is True and tok.encode("kato")[0] == 1
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_folder_with_tokenizer_model(sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    config = {
        "add_bos_token": False,
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_tokenizer(tmp_path)
    assert tok.add_bos_token is False and tok.encode("kato") == tok.encode("kato", False)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert {2, 3, tok.token_to_id("<|im_end|>")} == tok.eos_token_ids
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        "<s>[user] x<|im_end|>\n"
    )


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenization(sp_model, seed):
    tok = load_tokenizer(sp_model)
    rng = random.Random(seed)
    text = " ".join(rng.sample(TEXTS, len(TEXTS)))
    ids = tok.encode(text, add_special_tokens=False)
    for prompt in (None, tok.encode("kato rimon")):
        detok = IncrementalDetokenizer(tok, prompt)
        pieces, k = [], 0
        while k < len(ids):
            n = rng.randint(1, 3)
            pieces.append(detok.add(ids[k : k + n]))
            assert "\ufffd" not in pieces[-1]
            k += n
        pieces.append(detok.flush())
        assert "".join(pieces) == detok.text
        if prompt is None:
            assert detok.text == tok.decode(ids)
        else:
            # The continuation of the prompt's text: a leading word keeps its space.
            assert detok.text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
