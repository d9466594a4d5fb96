"""Structured output through the engine: on the default model (real numerics, temperature 1),
every JSON-schema, regex, choice and grammar output is valid; on random:tiny (mechanisms), the
unconstrained rows of a mixed batch are untouched, nothing recompiles, and logit_bias,
allowed_token_ids and bad_words do what they say."""

import concurrent.futures
import json
import re

import jsonschema
import pytest

from engine.errors import ParamError
from engine.sampling_params import SamplingParams
from engine.step.model_runner import num_backend_compilations
from engine.structured_params import StructuredOutputsParams
from tests.engine.conftest import run_to_completion, scheduler_as
from tests.engine.structured_cases import random_schemas

PROMPT = "JSON object:\n"


def _run(engine, prompt, params_list, prefix):
    """Compiles every grammar on a thread pool (as the server does), then runs them all."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(lambda p: p.structured_outputs and engine.compile_grammar(p.structured_outputs),
                                 params_list))
    for i, (params, grammar) in enumerate(zip(params_list, grammars)):
        engine.add_request(f"{prefix}-{i}", prompt, params, grammar=grammar)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"{prefix}-{i}"] for i in range(len(params_list))]


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_fifty_random_schemas_all_validate_at_temperature_one(engine):
    schemas = random_schemas(50, seed=0)
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i,
                             structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    outputs = _run(engine, PROMPT, params, "schema")
    for schema, out in zip(schemas, outputs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.get_stats().num_constrained_requests >= 50


def test_regex_choice_and_grammar_always_match(engine):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["positive", "negative", "neutral"]
    arithmetic = 'start: expr\nexpr: term (OP term){0,3}\nterm: NUM | "(" NUM OP NUM ")"\nOP: "+" | "-" | "*"\nNUM: /0|[1-9][0-9]{0,2}/'
    gbnf = 'root ::= "x=" [0-9]{1,3} ("," [0-9]{1,3}){0,2}'
    kinds = [StructuredOutputsParams(regex=regex)] * 4 + [StructuredOutputsParams(choice=choices)] * 4
    kinds += [StructuredOutputsParams(grammar=arithmetic)] * 4 + [StructuredOutputsParams(grammar=gbnf)] * 2
    params = [SamplingParams(temperature=1.0, max_tokens=32, seed=i, structured_outputs=so)
              for i, so in enumerate(kinds)]
    outputs = _run(engine, "Answer:", params, "kinds")
    for so, out in zip(kinds, outputs):
        assert out.finish_reason == "stop", out.text
        if so.regex:
            assert re.fullmatch(regex, out.text), out.text
        elif so.choice:
            assert out.text in choices
        elif so.grammar == gbnf:
            assert re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3}){0,2}", out.text), out.text
        else:
            assert re.fullmatch(r"[0-9()+\-* ]+", out.text), out.text
            eval(out.text, {"__builtins__": {}})  # parses (and evaluates) as an arithmetic expression


def test_constrained_neighbours_leave_greedy_rows_alone_and_nothing_recompiles(tiny_engine):
    prompts = [f"prompt number {i}" for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["k", "n"], "additionalProperties": False}
    constrained = SamplingParams(temperature=1.0, max_tokens=24, seed=3,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    alone = run_to_completion(tiny_engine, [(f"alone-{i}", p, greedy) for i, p in enumerate(prompts)])
    compilations = num_backend_compilations()
    mixed = []
    for i, p in enumerate(prompts):
        mixed += [(f"mixed-{i}", p, greedy), (f"json-{i}", p, constrained)]
    done = run_to_completion(tiny_engine, mixed)
    assert num_backend_compilations() == compilations
    for i in range(8):
        assert done[f"mixed-{i}"].outputs[0].token_ids == alone[f"alone-{i}"].outputs[0].token_ids
        out = done[f"json-{i}"].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_logit_bias_allowed_token_ids_and_bad_words(tiny_engine):
    a, b = ord("a"), ord("b")
    done = run_to_completion(tiny_engine, [
        ("bias", "hello", SamplingParams(temperature=1.0, max_tokens=8, seed=1, logit_bias={ord("z"): 100})),
        ("allowed", "hello", SamplingParams(temperature=1.0, max_tokens=24, seed=2, allowed_token_ids=[a, b])),
        ("bad", "hello", SamplingParams(temperature=1.0, max_tokens=24, seed=2, allowed_token_ids=[a, b, 32],
                                        bad_words=["ab", "bb"])),
        ("plain", "hello", SamplingParams(temperature=0.0, max_tokens=8)),
    ])
    assert done["bias"].outputs[0].text == "z" * 8
    assert set(done["allowed"].outputs[0].text) <= {"a", "b"} and len(done["allowed"].outputs[0].token_ids) == 24
    bad = done["bad"].outputs[0].text
    assert set(bad) <= {"a", "b", " "} and "ab" not in bad and "bb" not in bad and len(bad) == 24
    with pytest.raises(ParamError) as info:
        tiny_engine.add_request("oob", "hello", SamplingParams(logit_bias={10_000: 1.0}))
    assert info.value.param == "logit_bias"
    with pytest.raises(ParamError) as info:
        tiny_engine.add_request("oob", "hello", SamplingParams(allowed_token_ids=[10_000]))
    assert info.value.param == "allowed_token_ids"
    assert not tiny_engine.has_unfinished_requests()


def test_compiler_lru_and_errors_name_the_field(tiny_engine):
    compiler = tiny_engine.grammar_compiler
    so = StructuredOutputsParams(regex="[ab]{2}")
    first, hits = compiler.compile(so), compiler.stats.num_cache_hits
    assert compiler.compile(StructuredOutputsParams(regex="[ab]{2}")) is first
    assert compiler.stats.num_cache_hits == hits + 1
    cases = [(StructuredOutputsParams(json={"type": "foo"}), "structured_outputs.json"),
             (StructuredOutputsParams(json='{"type": "object", "not": {}}'), "structured_outputs.json"),
             (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
             (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
             (StructuredOutputsParams(grammar="start: missing"), "structured_outputs.grammar"),
             (StructuredOutputsParams(json={"type": "foo"}, param="response_format.json_schema.schema"),
              "response_format.json_schema.schema")]
    for bad, param in cases:
        with pytest.raises(ParamError) as info:
            compiler.compile(bad)
        assert info.value.param == param, info.value
    with pytest.raises(ParamError) as info:
        SamplingParams(logit_bias={1: 100.5})
    assert info.value.param == "logit_bias"


def test_grammar_state_survives_preemption_and_n_samples(tiny_engine):
    schema = {"type": "object", "properties": {"v": {"type": "array", "items": {"enum": ["ab", "cd"]},
              "minItems": 3, "maxItems": 3}}, "required": ["v"], "additionalProperties": False}
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=5,
                            structured_outputs=StructuredOutputsParams(json=schema))
    with scheduler_as(tiny_engine, enable_prefix_caching=False, num_kv_blocks=17) as sched:
        done = run_to_completion(tiny_engine, [(f"p{i}", "x" * 40, params) for i in range(4)])
        assert sched.stats.num_preemptions > 0
    for out in done.values():
        assert len(out.outputs) == 2
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), schema)
