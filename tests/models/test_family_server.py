"""A transformers-saved folder of each new family (qwen3, gemma2, gemma3_text, mixtral: sharded
safetensors with an index, qwen3_moe; a word-level tokenizer, a chat template in
tokenizer_config.json) served by the real OpenAI server process, one server per folder: the chat
request's prompt is what transformers' apply_chat_template gives (the same token ids, recorded in
the fixture), and its greedy answer is the completion of those ids, which
tests/models/test_families.py shows equal to transformers' own greedy tokens."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))
from server_launcher import ServerProcess, http  # noqa: E402

# Transformers-saved folders through the server: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

FIXTURES = ROOT / "tests" / "fixtures" / "hf_family"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
CHAT = REFERENCE["chat"]
FLAGS = ("--max_num_seqs=2", "--max_num_batched_tokens=16", "--max_model_len=64",
         "--block_size=4", "--num_kv_blocks=40", "--token_buckets=16", "--seq_buckets=2",
         "--noprompt_scoring_bucket", "--compilation_cache_dir=")


@pytest.fixture(scope="module", params=sorted(REFERENCE["models"]))
def server(request):
    proc = ServerProcess(f"--model={FIXTURES / request.param}", *FLAGS, fake=False, startup_timeout=600).start()
    yield proc
    assert proc.terminate(timeout=60) == 0, proc.output()[-3000:]


def test_chat_through_the_template_equals_the_completion_of_transformers_prompt(server):
    # Special tokens kept in the text: a tiny random model may answer with them only (gemma2's
    # greedy answer here is <|assistant|> six times).
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    status, _, text = http("POST", server.url + "/v1/chat/completions", {"messages": CHAT["messages"], **sampling})
    assert status == 200, text
    answer = json.loads(text)
    assert answer["usage"]["prompt_tokens"] == len(CHAT["prompt_token_ids"])
    status, _, text = http("POST", server.url + "/v1/completions", {"prompt": CHAT["prompt_token_ids"], **sampling})
    assert status == 200, text
    completion = json.loads(text)
    assert answer["usage"]["completion_tokens"] == completion["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert answer["choices"][0]["message"]["content"].strip()


def test_the_chat_template_renders_transformers_token_ids():
    from text.tokenizer import load_tokenizer

    for name in sorted(REFERENCE["models"]):
        tokenizer = load_tokenizer(str(FIXTURES / name))
        assert tokenizer.encode_chat(CHAT["messages"]) == CHAT["prompt_token_ids"], name
