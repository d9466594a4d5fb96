"""Bad input gets the right 4xx in OpenAI's error format, naming the field; the server keeps serving.

The server runs with --api_key, so the same process also checks 401s.
"""

import json
import pathlib
import sys

import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import ServerProcess, http, parse_metrics  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_MODEL_LEN = 128
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(f"--api_key={KEY}", f"--max_model_len={MAX_MODEL_LEN}", "--fake_step_sleep=0.002").start()
    yield proc
    assert proc.terminate() == 0, proc.output()


def _post(server, path, body, headers=AUTH):
    status, response_headers, text = http("POST", server.url + path, body, headers)
    return status, response_headers, json.loads(text)


# (path, body, status, the param named, a word the message must contain)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

BAD_REQUESTS = [
    (COMP, "{not json", 400, None, "JSON"),
    (COMP, "[1, 2]", 400, None, "object"),
    (COMP, {"max_tokens": 4}, 400, "prompt", "required"),
    (COMP, {"prompt": 5}, 400, "prompt", "prompt"),
    (COMP, {"prompt": ""}, 400, "prompt", "empty"),
    (COMP, {"prompt": [1, -2]}, 400, "prompt", "token ids"),
    (COMP, {"prompt": [[1], "a"]}, 400, "prompt", "prompt"),
    (COMP, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    (COMP, {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens", "integer"),
    (COMP, {"prompt": "a", "n": 0}, 400, "n", "'n'"),
    (COMP, {"prompt": "a", "n": 17}, 400, "n", "'n'"),
    (COMP, {"prompt": "a", "top_p": 2}, 400, "top_p", "top_p"),
    (COMP, {"prompt": "a", "top_p": 0}, 400, "top_p", "top_p"),
    (COMP, {"prompt": "a", "temperature": -0.5}, 400, "temperature", "temperature"),
    (COMP, {"prompt": "a", "temperature": "hot"}, 400, "temperature", "number"),
    (COMP, {"prompt": "a", "top_k": -5}, 400, "top_k", "top_k"),
    (COMP, {"prompt": "a", "min_p": 1.5}, 400, "min_p", "min_p"),
    (COMP, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    (COMP, {"prompt": "a", "frequency_penalty": -2.5}, 400, "frequency_penalty", "frequency_penalty"),
    (COMP, {"prompt": "a", "seed": "abc"}, 400, "seed", "integer"),
    (COMP, {"prompt": "a", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (COMP, {"prompt": "a", "stop": ["x"] * 100}, 400, "stop", "at most"),
    (COMP, {"prompt": "a", "stop": [1]}, 400, "stop", "stop"),
    (COMP, {"prompt": "a", "stream": "yes"}, 400, "stream", "boolean"),
    (COMP, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMP, {"prompt": "a", "logit_bias": {"x5": 1}}, 400, "logit_bias", "token ids"),
    (COMP, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    (COMP, {"prompt": "a", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (COMP, {"prompt": "x" * MAX_MODEL_LEN}, 400, "prompt", "max_model_len"),
    (COMP, {"prompt": "x" * 100, "max_tokens": 100}, 400, "max_tokens", "max_model_len"),
    (CHAT, {"messages": []}, 400, "messages", "empty"),
    (CHAT, {"messages": "hi"}, 400, "messages", "array"),
    (CHAT, {}, 400, "messages", "required"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content", "text"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", "max_completion_tokens"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]", "function"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type", "json_schema"),
    (CHAT, {"messages": MSG, "model": 3}, 400, "model", "string"),
    # Structured output and tools: each bad grammar is named, checked before the engine sees it.
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, 400, "response_format.json_schema.schema", "invalid type"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400,
     "response_format.json_schema.schema", "unimplemented"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400,
     "response_format.json_schema.schema", "object"),
    (COMP, {"prompt": "a", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs.regex", "regex"),
    (COMP, {"prompt": "a", "structured_outputs": {"grammar": "start: foo"}}, 400, "structured_outputs.grammar",
     "unknown name"),
    (COMP, {"prompt": "a", "structured_outputs": {"json": {"type": "integer", "minimum": "x"}}}, 400,
     "structured_outputs.json", "minimum"),
    (COMP, {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs",
     "exactly one"),
    (COMP, {"prompt": "a", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice", "non-empty"),
    (COMP, {"prompt": "a", "structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml", "supported"),
    (COMP, {"prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids", "token ids"),
    (COMP, {"prompt": "a", "bad_words": [3]}, 400, "bad_words", "strings"),
    (COMP, {"prompt": "a", "tools": [TOOL]}, 400, "tools", "chat"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}]},
     400, "tools[0].function.parameters", "schema"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, 400, "tools[0].function.parameters", "nope"),
    (CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     400, "tool_choice", "not in 'tools'"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice", "tools"),
    (CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "tool_choice", "cannot be combined"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages", "max_model_len"),
]


@pytest.mark.parametrize("path,body,status,param,word", BAD_REQUESTS)
def test_bad_request_is_named(server, path, body, status, param, word):
    got, _, payload = _post(server, path, body)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert word.lower() in error["message"].lower()
    if status == 404:
        assert error["code"] == "model_not_found"


def test_auth(server):
    body = {"prompt": "a", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, payload = _post(server, COMP, body, headers)
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    assert http("GET", server.url + "/v1/models")[0] == 401
    assert http("GET", server.url + "/health")[0] == 200  # probes need no key
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="fake-model", prompt="a", max_tokens=2)


def test_routes_and_size_limit(server):
    status, _, text = http("GET", server.url + "/v1/nothing", headers=AUTH)
    assert status == 404 and "error" in json.loads(text)
    status, _, text = http("GET", server.url + COMP, headers=AUTH)
    assert status == 405 and "error" in json.loads(text)
    status, _, text = http("POST", server.url + COMP, b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', AUTH)
    assert status == 413 and "error" in json.loads(text)


def test_openai_client_sees_errors_and_good_requests_still_work(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="a", top_p=2.0)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    out = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_failing_engine_step_fails_only_its_requests(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="fake-model", prompt="please FAIL_STEP now", max_tokens=3)
    assert "injected step failure" in info.value.body["message"]
    status, _, text = http("POST", server.url + COMP, {"prompt": "FAIL_STEP", "stream": True}, AUTH)
    assert status == 200 and '"error"' in text and text.endswith("data: [DONE]\n\n")
    out = client.completions.create(model="fake-model", prompt="fine", max_tokens=4)
    assert out.usage.completion_tokens == 4
    metrics = parse_metrics(http("GET", server.url + "/metrics")[2])
    assert metrics["jaxserve:num_requests_running"] == 0 and metrics["jaxserve:kv_cache_usage_perc"] == 0
    assert metrics["jaxserve:engine_step_errors_total"] == 2
    assert http("GET", server.url + "/health")[0] == 200
