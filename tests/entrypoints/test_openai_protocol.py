"""Unit tests of request parsing, response pieces and the Prometheus rendering (no server)."""

import dataclasses

import prometheus_client
import pytest

from engine.metrics import Histogram, ServerMetrics
from engine.outputs import CompletionOutput
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.protocol import (
    check_context,
    parse_chat_request,
    parse_completion_request,
)
from entrypoints.openai.responses import (
    ChoiceCursor,
    TokenTexts,
    advance,
    chat_logprobs,
    completion_logprobs,
)

NAMES = ("m",)


def test_completion_defaults_follow_openai():
    req = parse_completion_request({"prompt": "hi", "user": "someone", "extra_vendor_field": [1]}, NAMES)
    assert req.model is None and req.prompts == ["hi"] and not req.stream and not req.echo
    p = req.params
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs) == (1, 16, 1.0, 1.0, -1, None)


def test_completion_fields_reach_sampling_params():
    body = {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3,
            "min_p": 0.1, "seed": 4, "stop": "x", "n": 2, "presence_penalty": 1, "frequency_penalty": -1,
            "stream": True, "stream_options": {"include_usage": True}, "echo": True,
            "best_of": 2, "ignore_eos": True, "stop_token_ids": [7]}
    req = parse_completion_request(body, NAMES)
    assert req.prompts == [[1, 2], [3]] and req.stream and req.include_usage and req.echo
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.0, 0.5, 3, 0.1, 4)
    assert (p.stop, p.n, p.presence_penalty, p.frequency_penalty, p.logprobs) == (("x",), 2, 1.0, -1.0, None)
    assert parse_completion_request({"prompt": "a", "logprobs": 0}, NAMES).params.logprobs == 0
    assert p.ignore_eos and p.stop_token_ids == (7,)


def test_integral_floats_are_integers_but_fractions_are_not():
    assert parse_completion_request({"prompt": "a", "max_tokens": 8.0}, NAMES).params.max_tokens == 8
    with pytest.raises(ProtocolError) as info:
        parse_completion_request({"prompt": "a", "max_tokens": 8.5}, NAMES)
    assert info.value.param == "max_tokens"


def test_chat_parsing():
    body = {"messages": [{"role": "developer", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          "name": "bob"}],
            "max_tokens": 3, "max_completion_tokens": 9, "logprobs": True}
    req = parse_chat_request(body, NAMES)
    assert req.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\nb"}]
    assert req.params.max_tokens == 9  # max_completion_tokens wins
    assert req.logprobs and req.params.logprobs == 0
    assert parse_chat_request({"messages": [{"role": "user", "content": "x"}]}, NAMES).params.max_tokens is None


@pytest.mark.parametrize("body,param,status", [
    ({"prompt": "a", "model": "other"}, "model", 404),
    ({"prompt": "a", "n": True}, "n", 400),
    ({"prompt": "a", "temperature": float("nan")}, "temperature", 400),
    ({"prompt": "a", "best_of": 3}, "best_of", 400),
    ({"prompt": "a", "suffix": "z"}, "suffix", 400),
    ({"prompt": "a", "stop": ["y" * 300]}, "stop", 400),
    ({"prompt": "a", "stream": True, "stream_options": 1}, "stream_options", 400),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", 400),
    ({"prompt": "a", "stop_token_ids": ["x"]}, "stop_token_ids", 400),
    ({"prompt": [[1], []]}, "prompt", 400),
    ({"prompt": ["a"] * 65}, "prompt", 400),
])
def test_completion_errors_name_the_field(body, param, status):
    with pytest.raises(ProtocolError) as info:
        parse_completion_request(body, NAMES)
    assert (info.value.param, info.value.status) == (param, status)
    assert info.value.to_dict()["error"]["param"] == param


def test_chat_errors_name_the_message():
    with pytest.raises(ProtocolError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "ok"}, {"content": "no role"}]}, NAMES)
    assert info.value.param == "messages[1].role"
    with pytest.raises(ProtocolError) as info:
        parse_chat_request({"messages": [{"role": "assistant", "content": None}]}, NAMES)
    assert info.value.param == "messages[0].content"
    with pytest.raises(ProtocolError) as info:
        parse_chat_request("text", NAMES)
    assert info.value.status == 400 and "object" in info.value.message


def test_context_check():
    check_context(10, 6, 16, prompt_param="prompt")
    with pytest.raises(ProtocolError) as info:
        check_context(16, None, 16, prompt_param="messages")
    assert info.value.param == "messages" and "max_model_len" in info.value.message
    with pytest.raises(ProtocolError) as info:
        check_context(10, 7, 16, prompt_param="prompt")
    assert info.value.param == "max_tokens"


def test_cursor_sends_only_what_is_new():
    cursor = ChoiceCursor()
    delta = advance(cursor, CompletionOutput(index=0, text="ab", token_ids=[1, 2]))
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("ab", [1, 2], None)
    assert advance(cursor, CompletionOutput(index=0, text="ab", token_ids=[1, 2])) is None
    delta = advance(cursor, CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3], finish_reason="stop"))
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("c", [3], "stop")
    assert advance(cursor, CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3], finish_reason="stop")) is None


class _Tok:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_logprob_formats():
    texts = TokenTexts(_Tok())
    completion = CompletionOutput(index=0, text="ab", token_ids=[1, 2],
                                  logprobs=[{1: -0.5, 3: -0.2, 4: -3.0}, {2: -0.1}])
    delta = advance(ChoiceCursor(), completion)
    cursor = ChoiceCursor(text_offset=5)
    legacy = completion_logprobs(texts, cursor, delta, 2)
    assert legacy["tokens"] == ["a", "b"] and legacy["token_logprobs"] == [-0.5, -0.1]
    assert legacy["top_logprobs"] == [{"c": -0.2, "a": -0.5}, {"b": -0.1}]
    assert legacy["text_offset"] == [5, 6] and cursor.text_offset == 7
    chat = chat_logprobs(texts, delta, 1)["content"]
    assert chat[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                       "top_logprobs": [{"token": "c", "logprob": -0.2, "bytes": [99]}]}


@dataclasses.dataclass
class _Stats:
    num_running: int = 2
    num_waiting: int = 1
    kv_cache_usage: float = 0.25
    prefix_cache_queries: int = 100
    prefix_cache_hits: int = 40
    num_preemptions: int = 0
    num_prompt_tokens: int = 100
    num_generation_tokens: int = 7
    num_compilations: int = 5


def test_histogram_is_cumulative():
    hist = Histogram("x_seconds", "help", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    lines = prometheus_client.generate_latest(hist.registry).decode().splitlines()
    assert lines[:2] == ["# HELP jaxserve:x_seconds help", "# TYPE jaxserve:x_seconds histogram"]
    assert lines[2:] == ['jaxserve:x_seconds_bucket{le="0.1"} 2.0', 'jaxserve:x_seconds_bucket{le="1.0"} 3.0',
                         'jaxserve:x_seconds_bucket{le="+Inf"} 4.0', "jaxserve:x_seconds_count 4.0",
                         "jaxserve:x_seconds_sum 3.65"]


def test_server_metrics_render():
    metrics = ServerMetrics()
    metrics.observe_first_token(0.2)
    metrics.observe_inter_token(0.3, 3)  # three tokens in one arrival: three samples of 0.1
    metrics.observe_finished(1.0, "length")
    metrics.observe_http_response(200)
    text = metrics.render(_Stats(), num_pending=2)
    lines = set(text.splitlines())
    assert "jaxserve:num_requests_running 2.0" in lines
    assert "jaxserve:num_requests_waiting 3.0" in lines
    assert "jaxserve:kv_cache_usage_perc 0.25" in lines
    assert "jaxserve:prefix_cache_hit_rate 0.4" in lines
    assert "jaxserve:num_compilations_total 5.0" in lines
    assert 'jaxserve:request_success_total{finished_reason="length"} 1.0' in lines
    assert "jaxserve:inter_token_latency_seconds_count 3.0" in lines
    assert "jaxserve:time_to_first_token_seconds_count 1.0" in lines
    assert any(line.startswith("process_cpu_seconds_total ") for line in lines)  # prometheus_client's process metrics
    for line in text.splitlines():
        name = line.split(" ")[2] if line.startswith("#") else line
        assert name.startswith(("jaxserve:", "process_", "python_")), line
    assert not any("_created" in line for line in lines)
    assert text.endswith("\n")
