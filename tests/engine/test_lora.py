"""LoRA adapters served by the engine (random:tiny), against the base model with each adapter
merged into its weights (W + scale * B A, models/lora.merge_lora):

- greedy output with an adapter equals the merged model's (teacher-forced dense argmax: the
  first sampled token's logprob within 1e-4 of its log-softmax, float32; later ones 3e-4); alone
  and in one batch of the base model and four adapters under each speculative method, and with
  structured output: test_lora_spec.py;
- eight adapters over two device slots, requests interleaved: every output equal to its merged
  reference, slots evicted and refilled, nothing compiled (the engine's compile counter), on
  LoRA rank buckets 4 and 8 (a step's products stop at its adapters' highest rank);
- the prefix cache: the same prompt under two adapters computes its own blocks and output;
- through the OpenAI server with the official `openai` client: model=<adapter> (streaming
  too), /v1/models with `parent`, 404 for an unknown adapter, a broken adapter loaded at run time
  is a 400 naming the tensor and the server keeps serving, load/unload behind the API key.
"""

import asyncio
import dataclasses
import json
import threading
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.lora_config import LoRARequest
from engine.sampling_params import SamplingParams
from engine.step.model_runner import num_backend_compilations
from engine.structured_params import StructuredOutputsParams
from tests.engine.lora_cases import (
    GREEDY,
    KNOBS,
    NEW_TOKENS,
    PROMPTS,
    SCHEMA,
    build_setup,
    check_greedy,
    run_jobs,
)
from tests.models.lora_files import adapter_tensors, write_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("adapters"))


def _engine(**knobs):
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**{**KNOBS, **knobs}), progress=False)


@pytest.fixture(scope="module")
def engine2(setup):
    """Two slots, and LoRA rank buckets: a step computes over rank 4 when its adapters' ranks
    allow it (every SPECS adapter but 0, 3 and 5; a bucket 0, no adapter products, is one more
    program per shape: left to the bucket-choice test)."""
    return _engine(max_loras=2, max_cpu_loras=3, lora_modules=(f"adapter0={setup['paths'][0]}",),
                   lora_rank_buckets=(4, 8))


def test_eight_adapters_over_two_slots_without_recompiling(setup, engine2):
    prompts, loras = setup["prompts"], setup["requests"]
    run_jobs(engine2, [("warm", prompts[0], loras[0])])
    before = num_backend_compilations()
    order = [0, 4, 1, 5, 2, 6, 3, 7, 0, 7]  # interleaved; each adapter's requests land in turn
    outs, most = run_jobs(engine2, [(f"r{j}", prompts[j % 5], loras[i]) for j, i in enumerate(order)])
    assert num_backend_compilations() == before  # nothing compiled: slots fill by a compiled write
    assert most == 2
    slots = engine2.runner.lora
    assert slots.num_evictions >= 6 and engine2.lora_manager.num_disk_loads > 8  # host LRU (3) reloads too
    assert engine2.runner.lora_rank_steps.get(4, 0) > 0 and engine2.runner.lora_rank_steps.get(8, 0) > 0
    for j, i in enumerate(order):
        check_greedy(setup, i + 1, prompts[j % 5], outs[f"r{j}"])


def test_prefix_cache_keeps_adapters_apart(setup, engine2):
    prompt = setup["prompts"][2] * 2
    assert len(prompt) == 56  # three full blocks
    loras = setup["requests"]
    first, _ = run_jobs(engine2, [("p1", prompt, loras[1])])
    again, _ = run_jobs(engine2, [("p1b", prompt, loras[1])])
    other, _ = run_jobs(engine2, [("p2", prompt, loras[2])])
    base, _ = run_jobs(engine2, [("p0", prompt, None)])
    assert again["p1b"].metrics.num_cached_tokens == 48  # its own blocks are found again
    assert other["p2"].metrics.num_cached_tokens == 0 and base["p0"].metrics.num_cached_tokens == 0
    check_greedy(setup, 2, prompt, again["p1b"])
    check_greedy(setup, 3, prompt, other["p2"])
    check_greedy(setup, 0, prompt, base["p0"])
    assert first["p1"].outputs[0].token_ids == again["p1b"].outputs[0].token_ids


def test_engine_refuses_adapters_by_name(setup, engine2):
    from engine.errors import ParamError

    with pytest.raises(ParamError, match="lora_int_id 1 is already 'adapter0'"):
        engine2.add_request("x", [1, 2], GREEDY, lora_request=LoRARequest("other", 1, setup["paths"][3]))
    with pytest.raises(ValueError, match="data_parallel_size does not run with LoRA"):
        EngineConfig(**{**KNOBS, "data_parallel_size": 2})
    with pytest.raises(ValueError, match="lora_modules needs enable_lora=True"):
        EngineConfig(lora_modules=("a=/nowhere",))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match=r"lora_rank_buckets must be increasing integers >= 0 ending at max_lora_rank \(8\)"):
        EngineConfig(**{**KNOBS, "lora_rank_buckets": (0, 4)})
    with pytest.raises(ValueError, match="lora_rank_buckets: tensor_parallel_size does not run"):
        EngineConfig(**{**KNOBS, "lora_rank_buckets": (4, 8), "tensor_parallel_size": 2})


def test_rank_buckets_pick_the_smallest_rank_holding_the_step(engine2):
    assert engine2.runner.shapes.lora_ranks == (4, 8)
    shapes = dataclasses.replace(engine2.runner.shapes, lora_ranks=(0, 4, 8))
    assert len(shapes.all_buckets()) == 3 and {b.lora_rank for b in shapes.all_buckets()} == {0, 4, 8}
    assert [shapes.bucket_for(20, 3, lora_rank=r).lora_rank for r in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    plain = dataclasses.replace(shapes, lora_ranks=())
    assert plain.bucket_for(20, 3, lora_rank=5).lora_rank is None  # no rank buckets: the whole rank


KEY = "lora-test-key"


@pytest.fixture(scope="module")
def server(engine2):
    """The OpenAI server over engine2 in this process (an event loop on a thread)."""
    from aiohttp import web

    from entrypoints.openai.api_server import OpenAIServer, ServerConfig

    app_server = OpenAIServer(engine2, ServerConfig(port=0, api_key=KEY))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        app_server.async_engine.start()
        runner = app_server.make_runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield url

    async def stop():
        await app_server.async_engine.shutdown()
        await runner.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def expected(setup, engine2):
    """Texts the server must answer, from the engine offline (each checked against its merged
    reference) before the server takes the engine over: adapter 0, adapter 5, the base, and
    adapter 0 under a JSON schema (test_lora_spec.py checks such outputs against the merged model)."""
    prompt = setup["prompts"][1]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs, _ = run_jobs(engine2, [("e0", prompt, setup["requests"][0]), ("e5", prompt, setup["requests"][5]),
                             ("eb", prompt, None), ("ej", prompt, setup["requests"][0], constrained)])
    for rid, which in (("e0", 1), ("e5", 6), ("eb", 0)):
        check_greedy(setup, which, prompt, outs[rid])
    jsonschema.validate(json.loads(outs["ej"].outputs[0].text), SCHEMA)
    return {rid: outs[rid].outputs[0].text for rid in outs}


def test_server_with_the_openai_client(setup, expected, engine2, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert models["adapter0"].model_dump()["parent"] == engine2.model_name in models
    kwargs = dict(prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(model="adapter0", **kwargs)
    assert whole.choices[0].text == expected["e0"]
    json_out = client.completions.create(model="adapter0", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": {"json": SCHEMA}})
    assert json_out.choices[0].text == expected["ej"]  # structured output under an adapter
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="adapter0", stream=True, **kwargs)
                       if c.choices)
    assert streamed == expected["e0"]
    chat = client.chat.completions.create(model="adapter0", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "adapter0" and chat.choices[0].message.content is not None
    assert client.completions.create(model=engine2.model_name, **kwargs).choices[0].text == expected["eb"] != expected["e0"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", **kwargs)
    assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"

    headers = {"Authorization": f"Bearer {KEY}"}
    broken = write_adapter(setup["folder"] / "broken", setup["config"], rank=4, targets=("q_proj",),
                           tensors={**adapter_tensors(setup["config"], rank=4, targets=("q_proj",), seed=1),
                                    "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight":
                                        np.zeros((3, 4), np.float32)})
    status, body = _post(server + "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": broken}, headers)
    assert status == 400
    assert "model.layers.1.self_attn.q_proj.lora_B.weight has shape [3, 4]" in json.loads(body)["error"]["message"]
    assert _post(server + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": broken}, {})[0] == 401
    status, body = _post(server + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": setup["paths"][5]},
                         headers)
    assert status == 200, body
    late = client.completions.create(model="late", **kwargs)  # the server kept serving
    assert late.choices[0].text == expected["e5"]
    assert "late" in {m.id for m in client.models.list().data}
    assert _post(server + "/v1/unload_lora_adapter", {"lora_name": "late"}, headers)[0] == 200
    assert _post(server + "/v1/unload_lora_adapter", {"lora_name": "late"}, headers)[0] == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", **kwargs)


def _post(url: str, body: dict, headers: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
