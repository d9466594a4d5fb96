"""LoRA adapters served by the engine (random:tiny), against the base model with each adapter
merged into its weights (W + scale * B A, models/lora.merge_lora):

- greedy output with an adapter equals the merged model's (teacher-forced dense argmax), alone
  and in one batch that mixes the base model and four adapters, with n-gram speculative decoding
  on, and the first sampled token's logprob equals the merged model's log-softmax within 1e-4
  (float32; later ones 3e-4);
- eight adapters over two device slots, requests interleaved: every output equal to its merged
  reference, slots evicted and refilled, nothing compiled (the engine's compile counter);
- the prefix cache: the same prompt under two adapters computes its own blocks and output;
- through the OpenAI server with the official `openai` client: model=<adapter> (streaming
  too), /v1/models with `parent`, 404 for an unknown adapter, a broken adapter loaded at run time
  is a 400 naming the tensor and the server keeps serving, load/unload behind the API key.
"""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.lora_config import LoRARequest
from engine.sampling_params import SamplingParams
from engine.step.model_runner import num_backend_compilations
from models.llama import forward_dense
from models.loader import load_model
from models.lora import load_peft_adapter, merge_lora
from tests.models.lora_files import adapter_tensors, write_adapter

KNOBS = dict(model="random:tiny", enable_lora=True, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=32,
             max_model_len=96, block_size=16, num_kv_blocks=6 * 8 + 1, token_buckets=(32,), seq_buckets=(8,),
             compilation_cache_dir=None, prompt_scoring_bucket=False)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, alpha, targets, rsLoRA) of the eight adapters
SPECS = [(8, 16, ALL, False), (4, 8, ("q_proj", "v_proj"), False), (2, 4, ("o_proj", "down_proj"), True),
         (8, 8, ("gate_proj", "up_proj"), False), (3, 6, ("k_proj", "o_proj", "up_proj"), False),
         (6, 12, ALL, True), (1, 2, ("q_proj", "down_proj"), False), (5, 5, ("v_proj", "gate_proj"), False)]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
PROMPTS = ["The quick brown fox", "LoRA adapters, many at once", "0123456789 abcdefghij klmnop",
           "Hi", "Serving research engines"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    base = load_model("random:tiny")
    config = base.config
    paths = [write_adapter(folder / f"a{i}", config, rank=r, alpha=a, targets=t, rslora=rs, seed=10 + i, b_std=0.5)
             for i, (r, a, t, rs) in enumerate(SPECS)]
    requests = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    dense = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    merged = [base.params] + [merge_lora(base.params, config, load_peft_adapter(p, config, 8)) for p in paths]
    tok = base.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS]

    def reference(which, prompt, tokens):
        """Dense log-softmax at the positions that sampled `tokens` (which: 0 base, i + 1 adapter i)."""
        ids = prompt + tokens
        x = np.zeros(128, np.int32)
        x[: len(ids)] = ids
        logits = np.asarray(dense(jax.tree.map(jnp.asarray, merged[which]), jnp.asarray(x)))
        return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1 : len(ids) - 1], axis=-1))

    return dict(folder=folder, config=config, requests=requests, paths=paths, reference=reference, prompts=prompts)


def _engine(**knobs):
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**{**KNOBS, **knobs}), progress=False)


@pytest.fixture(scope="module")
def engine4():
    """Four slots, with n-gram speculative decoding (k = 3): adapters' drafts are verified by the
    adapted model, so greedy output stays the merged model's."""
    return _engine(max_loras=4, speculative_config=dict(
        method="ngram", num_speculative_tokens=3, disable_by_batch_size=None, disable_by_token_share=1.0,
        min_acceptance_rate=0.0))


@pytest.fixture(scope="module")
def engine2(setup):
    return _engine(max_loras=2, max_cpu_loras=3, lora_modules=(f"adapter0={setup['paths'][0]}",))


def _run(engine, jobs):
    """jobs: (request id, prompt ids, LoRARequest or None) -> {request id: CompletionOutput}; also
    the largest number of distinct adapters that ran in one step."""
    for rid, prompt, lora in jobs:
        engine.add_request(rid, prompt, GREEDY, **({"lora_request": lora} if lora else {}))
    outs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        most = max(most, len(engine.scheduler.lora_seats.active))
    return outs, most


def _check(setup, which, prompt, out):
    """Greedy tokens are the merged model's argmax; the first one's logprob (the prompt's last
    position) its log-softmax within 1e-4, the later ones' within 3e-4 (float32: the unmerged
    products round differently from the merged weights, and the differences ride in the cache)."""
    completion = out.outputs[0]
    assert completion.error is None and len(completion.token_ids) == NEW_TOKENS
    logp = setup["reference"](which, prompt, completion.token_ids)
    assert completion.token_ids == np.argmax(logp, axis=-1).tolist(), f"adapter {which}"
    got = np.array([lp[t] for lp, t in zip(completion.logprobs, completion.token_ids)])
    want = logp[np.arange(NEW_TOKENS), completion.token_ids]
    assert abs(got[0] - want[0]) < 1e-4
    np.testing.assert_allclose(got, want, atol=3e-4)


def test_alone_and_mixed_with_the_base_and_four_adapters(setup, engine4):
    prompts, loras = setup["prompts"], setup["requests"]
    alone, _ = _run(engine4, [("alone", prompts[1], loras[0])])
    _check(setup, 1, prompts[1], alone["alone"])
    jobs = [("base", prompts[0], None)] + [(f"m{i}", prompts[i + 1], loras[i]) for i in range(4)]
    outs, most = _run(engine4, jobs)
    assert most == 4  # the base model and four adapters in the same steps
    base_tokens = outs["base"].outputs[0].token_ids
    _check(setup, 0, prompts[0], outs["base"])
    for i in range(4):
        _check(setup, i + 1, prompts[i + 1], outs[f"m{i}"])
    assert outs["m0"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids
    same_prompt, _ = _run(engine4, [("b", prompts[1], None)])
    assert same_prompt["b"].outputs[0].token_ids != alone["alone"].outputs[0].token_ids  # the adapter matters
    assert base_tokens
    assert engine4.get_stats().spec_decode.num_draft_tokens > 0  # drafts were verified with adapters


def test_eight_adapters_over_two_slots_without_recompiling(setup, engine2):
    prompts, loras = setup["prompts"], setup["requests"]
    _run(engine2, [("warm", prompts[0], loras[0])])
    before = num_backend_compilations()
    order = [0, 4, 1, 5, 2, 6, 3, 7, 0, 7]  # interleaved; each adapter's requests land in turn
    outs, most = _run(engine2, [(f"r{j}", prompts[j % 5], loras[i]) for j, i in enumerate(order)])
    assert num_backend_compilations() == before  # nothing compiled: slots fill by a compiled write
    assert most == 2
    slots = engine2.runner.lora
    assert slots.num_evictions >= 6 and engine2.lora_manager.num_disk_loads > 8  # host LRU (3) reloads too
    for j, i in enumerate(order):
        _check(setup, i + 1, prompts[j % 5], outs[f"r{j}"])


def test_prefix_cache_keeps_adapters_apart(setup, engine2):
    prompt = setup["prompts"][2] * 2
    assert len(prompt) == 56  # three full blocks
    loras = setup["requests"]
    first, _ = _run(engine2, [("p1", prompt, loras[1])])
    again, _ = _run(engine2, [("p1b", prompt, loras[1])])
    other, _ = _run(engine2, [("p2", prompt, loras[2])])
    base, _ = _run(engine2, [("p0", prompt, None)])
    assert again["p1b"].metrics.num_cached_tokens == 48  # its own blocks are found again
    assert other["p2"].metrics.num_cached_tokens == 0 and base["p0"].metrics.num_cached_tokens == 0
    _check(setup, 2, prompt, again["p1b"])
    _check(setup, 3, prompt, other["p2"])
    _check(setup, 0, prompt, base["p0"])
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
    reference) before the server takes the engine over: adapter 0, adapter 5, the base."""
    prompt = setup["prompts"][1]
    outs, _ = _run(engine2, [("e0", prompt, setup["requests"][0]), ("e5", prompt, setup["requests"][5]),
                             ("eb", prompt, None)])
    for rid, which in (("e0", 1), ("e5", 6), ("eb", 0)):
        _check(setup, which, prompt, outs[rid])
    return {rid: outs[rid].outputs[0].text for rid in outs}


def test_server_with_the_openai_client(setup, expected, engine2, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert models["adapter0"].model_dump()["parent"] == engine2.model_name in models
    kwargs = dict(prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(model="adapter0", **kwargs)
    assert whole.choices[0].text == expected["e0"]
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
