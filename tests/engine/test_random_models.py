"""Random-weight models through the whole engine: a SentencePiece tokenizer trained in the test
drives a random model that generates, and sampling never leaves the tokenizer's vocabulary."""

import random

import pytest
import sentencepiece

from engine import LLM, SamplingParams

# Random models with trained tokenizers end to end: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "paper", "seven", "green"]


@pytest.fixture(scope="module")
def sp_model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 10))) + "." for _ in range(2000)]
    (folder / "corpus.txt").write_text("\n".join(lines))
    with open(folder / "train.log", "w") as log:
        sentencepiece.SentencePieceTrainer.train(
            input=str(folder / "corpus.txt"), model_prefix=str(folder / "tok"), vocab_size=100,
            model_type="bpe", character_coverage=1.0, logstream=log)
    return str(folder / "tok.model")


@pytest.fixture(scope="module")
def llm(sp_model_path):
    return LLM("random:tiny", tokenizer=sp_model_path, max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=128, token_buckets=(8, 32), seq_buckets=(4,), compilation_cache_dir=None, prompt_scoring_bucket=False,
               progress=False)


def test_sentencepiece_round_trips_and_random_model_generates(llm):
    tok = llm.tokenizer
    text = "alpha river stone. green light"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(["alpha beta", "seven green paper"], params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 12
        assert all(0 <= t < tok.vocab_size for t in completion.token_ids)  # model vocab is 256
        # The text continues the prompt's text (SentencePiece keeps the word's leading space).
        assert tok.decode(out.prompt_token_ids) + completion.text == tok.decode(
            out.prompt_token_ids + completion.token_ids)


def test_greedy_is_deterministic_across_batches(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["gamma delta"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["river", "gamma delta", "light paper stone"], greedy, use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_byte_tokenizer_random_model_chat():
    llm = LLM("random:tiny", max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
              token_buckets=(8, 32), seq_buckets=(2,), compilation_cache_dir=None, prompt_scoring_bucket=False,
              progress=False)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5,
                                                                        ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert "<user>hi" in llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
