"""Structured output and tool calls through the official openai client, against the real server
on the default model (the session's real_server): forced tool calls validate against their
schema and stream into the same call, `chat.completions.parse` with a Pydantic model, vLLM's
structured_outputs, logit_bias, /tokenize and /detokenize."""

import concurrent.futures
import json

import jsonschema
import openai
import pydantic
import pytest
from conftest import REAL_MODEL as MODEL
from server_launcher import http, parse_metrics

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.function.name:
                call["name"] += delta.function.name
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_and_stream_into_the_same_call(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=40,
                  temperature=1.0, seed=7)
    # Both at once (one batch, half the steps): seeded sampling gives a request the same tokens
    # whatever shares its batch.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(lambda: list(client.chat.completions.create(stream=True, **kwargs)))
        whole = client.chat.completions.create(**kwargs)
        chunks = streaming.result()
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    streamed, finish = _streamed_calls(chunks)
    assert finish == "tool_calls"
    assert streamed == [{"name": call.function.name, "arguments": call.function.arguments}]


def test_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        population_millions: int = pydantic.Field(ge=0, le=50)
        capital: bool

    out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                        response_format=City, max_tokens=48, temperature=1.0, seed=3)
    assert isinstance(out.choices[0].message.parsed, City)


def test_structured_outputs_logit_bias_and_token_routes(client, real_server):
    out = client.completions.create(model=MODEL, prompt="The sentiment of 'I love it' is", max_tokens=8,
                                    extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    assert out.choices[0].text in ("positive", "negative")
    # Greedy, with room to close the object: at temperature 1 a 32-token cap sometimes cut a long
    # string value (finish_reason "length": valid so far, but not a whole document).
    json_out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0,
                                              response_format={"type": "json_object"})
    assert json_out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(json_out.choices[0].message.content), dict)
    status, _, text = http("POST", real_server.url + "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(text)["tokens"]
    assert status == 200 and json.loads(text)["count"] == len(tokens) > 0
    status, _, text = http("POST", real_server.url + "/detokenize", {"tokens": tokens})
    assert status == 200 and json.loads(text)["prompt"] == "Hello world"
    status, _, text = http("POST", real_server.url + "/tokenize", {"messages": ASK})
    assert status == 200 and json.loads(text)["count"] > len(tokens)
    target = tokens[-1]
    biased = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=1.0,
                                       logit_bias={str(target): 100})
    status, _, text = http("POST", real_server.url + "/tokenize",
                           {"prompt": biased.choices[0].text, "add_special_tokens": False})
    assert json.loads(text)["tokens"] == [target] * 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", logit_bias={"7": 300})
    assert info.value.body["param"] == "logit_bias"
    status, _, text = http("POST", real_server.url + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and json.loads(text)["error"]["param"] == "tokens"
    metrics = parse_metrics(http("GET", real_server.url + "/metrics")[2])
    assert metrics["jaxserve:num_constrained_requests_total"] >= 2
    assert metrics["jaxserve:grammar_compile_seconds_total"] > 0
