"""Tool-call parsing and streaming without a model: Hermes / Qwen and Llama-3.1 outputs, the
chunks ToolStreamer sends, and how the tools reach the prompt."""

import json

from entrypoints.openai.prepare import Preparer
from entrypoints.openai.protocol import RequestLimits
from entrypoints.openai.tools import ToolStreamer, parse_tool_output, parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _plan(choice="auto"):
    return parse_tools({"tools": TOOLS, "tool_choice": choice})


def _stream(plan, pieces):
    streamer, bodies = ToolStreamer(plan), []
    for i, piece in enumerate(pieces):
        bodies.append(streamer.feed(piece, i == len(pieces) - 1))
    content = "".join(b.get("content", "") for b in bodies)
    calls = [c for b in bodies for c in b.get("tool_calls", [])]
    return content, calls, streamer.has_calls


def test_auto_parses_hermes_and_llama_calls():
    plan = _plan()
    hermes = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_output(plan, hermes)
    assert content == "Sure." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls = parse_tool_output(plan, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    two = '{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_weather", "parameters": {"city": "B"}}'
    assert len(parse_tool_output(plan, two)[1]) == 2
    for text in ("Just text.", '{"name": "unknown", "arguments": {}}', "<tool_call>not json</tool_call>"):
        assert parse_tool_output(plan, text) == (text, None)


def test_streaming_holds_back_what_may_be_a_call_and_matches_the_whole_answer():
    plan = _plan()
    pieces = ["Sure.", "<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
    content, calls, has_calls = _stream(plan, pieces)
    whole_content, whole_calls = parse_tool_output(plan, "".join(pieces))
    assert content == whole_content == "Sure." and has_calls
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    content, calls, has_calls = _stream(plan, ["Hello", " there", "."])
    assert content == "Hello there." and not calls and not has_calls
    named = _plan({"type": "function", "function": {"name": "get_weather"}})
    content, calls, _ = _stream(named, ['{"city"', ': "Rome"}', ""])
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def test_tools_reach_the_template_or_a_system_message():
    def preparer(template):
        return Preparer(tokenizer=_Tokenizer(template), max_model_len=4096, vocab_size=256, max_logprobs=5,
                        served_names=("m",), model_name="m", limits=RequestLimits(), max_queue_len=None)

    messages = [{"role": "user", "content": "hi"}]
    out, variables = preparer("{{ tools }}")._chat_messages(messages, _plan())
    assert out == messages and variables["tools"][0]["function"]["name"] == "get_weather"
    out, variables = preparer("{{ messages }}")._chat_messages(messages, _plan())
    assert not variables and out[0]["role"] == "system" and "<tools>" in out[0]["content"] and out[1:] == messages
    assert preparer("x")._chat_messages(messages, _plan("none")) == (messages, {})
