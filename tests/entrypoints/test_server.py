"""The server through the official openai client, against the fake engine in a real process.

The fake model's greedy continuation is computable here (fake_engine.candidate_logprobs), so texts,
token counts and logprobs are checked exactly, and streamed text must equal the whole response.
"""

import dataclasses
import math
import pathlib
import subprocess
import sys

import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fake_engine import FakeTokenizer, candidate_logprobs  # noqa: E402
from server_launcher import ServerProcess, http, parse_metrics  # noqa: E402

from engine.config import EngineConfig  # noqa: E402

MODEL = "fake-model"
TOK = FakeTokenizer()


def greedy_text(prompt_ids: list[int], num_tokens: int) -> str:
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        ids.append(candidate_logprobs(ids)[0][0])
    return TOK.decode(ids[len(prompt_ids):])


def chat_prompt_ids(messages) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(messages), add_special_tokens=False)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max_num_seqs=8", "--fake_step_sleep=0.005", "--max_model_len=256").start()
    yield proc
    assert proc.terminate() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_completion_greedy_matches_the_fake_model(client):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    [choice] = out.choices
    assert choice.text == greedy_text(TOK.encode("hello world"), 12)
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == len(TOK.encode("hello world"))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_stream_equals_whole_and_ends_with_usage(client):
    kwargs = dict(model=MODEL, prompt="stream me", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 5  # incremental, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=15, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert message.content == greedy_text(chat_prompt_ids(messages), 15)
    assert whole.usage.prompt_tokens == len(chat_prompt_ids(messages))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_developer_role(client):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": parts}],
        max_tokens=5, temperature=0)
    expected = chat_prompt_ids([{"role": "system", "content": "x"}, {"role": "user", "content": "one\ntwo"}])
    assert out.choices[0].message.content == greedy_text(expected, 5)


def test_prompt_list_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=["abc", "xyz"], max_tokens=4, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy_text(TOK.encode(p), 4) for p in ("abc", "xyz")]
    ids = TOK.encode("tokens")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == greedy_text(ids, 4)
    batch = client.completions.create(model=MODEL, prompt=[ids, TOK.encode("abc")], max_tokens=4, temperature=0)
    assert [c.text for c in batch.choices] == [greedy_text(ids, 4), greedy_text(TOK.encode("abc"), 4)]


def test_n_samples_with_seed_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="sample", max_tokens=10, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # the samples differ from each other
    assert first.usage.completion_tokens == 30
    streamed = client.completions.create(stream=True, **kwargs)
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]


def test_stop_string_ends_the_text_whole_and_streamed(client):
    full = greedy_text(TOK.encode("stop test"), 30)
    stop = full[10:12]
    cut = full[: full.index(stop)]
    out = client.completions.create(model=MODEL, prompt="stop test", max_tokens=30, temperature=0, stop=[stop, "@@"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="stop test", max_tokens=30, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    prompt_ids = TOK.encode("log")
    out = client.completions.create(model=MODEL, prompt="log", max_tokens=6, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text
    ids = list(prompt_ids)
    offset = 0
    for i in range(6):
        candidates = candidate_logprobs(ids)
        assert math.isclose(logprobs.token_logprobs[i], candidates[0][1], rel_tol=1e-6)
        assert len(logprobs.top_logprobs[i]) == 3
        assert logprobs.text_offset[i] == offset
        offset += len(logprobs.tokens[i])
        ids.append(candidates[0][0])
    streamed = list(client.completions.create(model=MODEL, prompt="log", max_tokens=6, temperature=0, logprobs=3, stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "lp"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == out.choices[0].message.content
    first = candidate_logprobs(chat_prompt_ids(messages))
    assert math.isclose(content[0].logprob, first[0][1], rel_tol=1e-6)
    assert [t.token for t in content[0].top_logprobs] == [TOK.decode([first[0][0]]), TOK.decode([first[1][0]])]
    assert content[0].bytes == list(content[0].token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(model=MODEL, prompt="echo", max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text == "echo" + greedy_text(TOK.encode("echo"), 3)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http("GET", server.url + "/health")[::2] == (200, '{"status": "ok"}')
    status, headers, text = http("GET", server.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_compilations_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        assert f"# TYPE jaxserve:{name} " in text, name
    samples = parse_metrics(text)
    assert samples["jaxserve:num_compilations_total"] == 3
    assert samples["jaxserve:generation_tokens_total"] > 0
    assert samples["jaxserve:time_to_first_token_seconds_count"] > 0
    assert samples['jaxserve:time_to_first_token_seconds_bucket{le="+Inf"}'] == samples["jaxserve:time_to_first_token_seconds_count"]
    assert samples["jaxserve:inter_token_latency_seconds_count"] > 0
    assert samples['jaxserve:http_responses_total{status="200"}'] > 0
    assert samples['jaxserve:request_success_total{finished_reason="length"}'] > 0


def test_every_engine_knob_is_a_flag_and_bad_values_are_refused():
    helped = subprocess.run([sys.executable, "-m", "entrypoints.openai.serve", "--helpfull"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).resolve().parents[2])
    for name in [f.name for f in dataclasses.fields(EngineConfig)] + ["host", "port", "api_key",
                                                                      "served_model_name", "max_queue_len"]:
        assert f"--{name}:" in helped.stdout or f"--[no]{name}:" in helped.stdout, name
    bad = subprocess.run([sys.executable, "-m", "entrypoints.openai.serve", "--block_size=0"], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert bad.returncode != 0 and "block_size" in bad.stderr + bad.stdout
