"""Prompt scoring under load (issue 32): a scored prompt (prompt_logprobs; `echo` with `logprobs`
on the server) advances by its share of the token budget like any prefill, because steps that
score a prompt run in the scoring bucket (the largest token bucket with a logit row per token,
engine/step/buckets.py), not in the few logit rows the decodes leave in a plain bucket.

Counted in engine steps, not seconds: on the default model, beside 19 decoding requests, a
720-token scored prompt needs at most its token-budget share of steps (within 5x of its steps
alone), finishes before any of the decodes, scores the same as alone, and nothing compiles.
Through LLM.generate, and through the OpenAI server (in-process) with `echo` + `logprobs`.
"""

import asyncio
import dataclasses
import math

import pytest

from engine.sampling_params import SamplingParams
from engine.step.buckets import Bucket, RunnerShapes
from engine.step.model_runner import num_backend_compilations
from scheduler import Request, Scheduler, SchedulerConfig, StepResult

# Prompt scoring under a 16-request load (issue 32): make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

NUM_DECODES = 19
BUDGET = 256
PROMPT_LEN = 720
# Few buckets: decodes in (32, 20, 20), prefills in (256, 20, 20), scored steps in (256, 20, 256).
KNOBS = dict(max_num_seqs=NUM_DECODES + 1, max_num_batched_tokens=BUDGET, max_model_len=1024,
             block_size=16, num_kv_blocks=160, token_buckets=(32, BUDGET), seq_buckets=(NUM_DECODES + 1,),
             enable_prefix_caching=False, compilation_cache_dir=None)
TEXT = ("The river rose in the night and by morning the low fields were under water. Farmers "
        "moved their animals to the hill, children carried bread and blankets to the old church, "
        "and the miller watched the wheel turn faster than it ever had. ")
SCORED = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=2, prompt_logprobs=2)
# The decodes outlast a scored prompt at its budget share (6 steps), not one squeezed to a row a step.
DECODE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- the shapes and the scheduler, without compiling ------------------------------------------


def test_the_scoring_bucket_serves_only_steps_no_plain_bucket_holds():
    shapes = RunnerShapes(token_buckets=(32, 256), seq_buckets=(20,), max_blocks_per_seq=64, num_blocks=160,
                          block_size=16, num_logprobs=2, sample_vocab_size=100)
    assert shapes.buckets() == [Bucket(32, 20, 20), Bucket(256, 20, 20)]
    assert shapes.scoring_bucket == Bucket(256, 20, 256) and shapes.max_logits == 256
    assert shapes.all_buckets() == [*shapes.buckets(), shapes.scoring_bucket]
    assert shapes.bucket_for(19, 19, 19) == Bucket(32, 20, 20)  # decodes
    assert shapes.bucket_for(200, 20, 20) == Bucket(256, 20, 20)  # a plain prefill
    assert shapes.bucket_for(30, 12, 30) == Bucket(256, 20, 256)  # a scored chunk: L = T
    ready = {shapes.buckets()[-1]}.__contains__  # background compile: the scoring bucket is ready
    assert shapes.bucket_for(30, 12, 30, ready=ready) == Bucket(256, 20, 256)
    off = dataclasses.replace(shapes, prompt_scoring=False)
    assert off.scoring_bucket is None and off.all_buckets() == off.buckets() and off.max_logits == 20
    # Where the plain largest bucket already has a row per token, there is nothing to add.
    small = dataclasses.replace(shapes, token_buckets=(8, 16))
    assert small.scoring_bucket is None and small.max_logits == 16


def test_with_logit_rows_for_the_whole_budget_a_scored_chunk_takes_what_the_decodes_leave():
    def chunks(max_num_logits):
        s = Scheduler(SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=BUDGET, max_model_len=1024,
                                      num_blocks=160, enable_prefix_caching=False, max_num_logits=max_num_logits))
        for i in range(NUM_DECODES):
            s.add_request(Request(f"d{i}", [5 + i, 6, 7, 8], max_tokens=1000))
        out = s.schedule()
        s.update(out, StepResult([sr.req_id for sr in out.scheduled], [[9]] * len(out.scheduled)))
        s.add_request(Request("scored", list(range(10, 10 + PROMPT_LEN)), max_tokens=2, prompt_logprobs=True))
        sizes = []
        while len(sizes) < 3:
            out = s.schedule()
            rows = {sr.req_id: sr for sr in out.scheduled}
            assert sum(sr.num_logits for sr in out.scheduled) <= max_num_logits
            sizes.append(rows["scored"].num_scheduled_tokens)
            sampling = [sr.req_id for sr in out.scheduled if sr.sample]
            s.update(out, StepResult(sampling, [[9]] * len(sampling)))
        return sizes

    assert chunks(BUDGET) == [BUDGET - NUM_DECODES] * 3  # the scoring bucket: the budget's share
    assert chunks(20) == [1, 1, 1]  # the plain bucket's 20 rows: what 19 decodes leave (issue 32)


# ---- the default model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(model="default", progress=False, **KNOBS)


@pytest.fixture(scope="module")
def prompt(llm):
    ids = llm.tokenizer.encode(TEXT * 30, add_special_tokens=False)[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    return ids


class StepCounter:
    """Wraps an engine's add_request and step: the step count when the latest scored request (the
    one with the long prompt) was added and when each request finished."""

    def __init__(self, engine, monkeypatch):
        self.steps, self.added, self.finished = 0, None, {}
        self.scored_id, self.decode_ids = None, set()
        add, step = engine.add_request, engine.step

        def counting_add(request_id, prompt, *args, **kwargs):
            if len(prompt) == PROMPT_LEN:
                self.scored_id, self.added = request_id, self.steps
            else:
                self.decode_ids.add(request_id)
            return add(request_id, prompt, *args, **kwargs)

        def counting_step():
            outs = step()
            self.steps += 1
            for out in outs:
                if out.finished:
                    self.finished.setdefault(out.request_id, self.steps)
            return outs

        monkeypatch.setattr(engine, "add_request", counting_add)
        monkeypatch.setattr(engine, "step", counting_step)

    @property
    def scored_steps(self) -> int:
        return self.finished[self.scored_id] - self.added

    def scored_finished_first(self) -> bool:
        """The scored request finished while every decode still ran."""
        done = [self.finished[rid] for rid in self.decode_ids if rid in self.finished]
        return len(self.decode_ids) == NUM_DECODES and self.finished[self.scored_id] < min(done, default=math.inf)


def _share_bound() -> int:
    """Steps a prompt needs at its share of the budget beside the decodes, plus its two samples."""
    return math.ceil(PROMPT_LEN / (BUDGET - NUM_DECODES)) + 2


def _assert_same_scores(got, want):
    assert len(got) == len(want) == PROMPT_LEN and got[0] is None and want[0] is None
    for pos in range(1, PROMPT_LEN):
        assert got[pos].keys() == want[pos].keys(), pos
        assert all(abs(got[pos][t] - want[pos][t]) < 1e-4 for t in got[pos]), pos


@pytest.fixture(scope="module")
def alone(llm, prompt):
    """The scored prompt alone on the idle engine: (its steps, its output)."""
    mp = pytest.MonkeyPatch()
    try:
        counter = StepCounter(llm.engine, mp)
        [out] = llm.generate([prompt], SCORED, use_tqdm=False)
    finally:
        mp.undo()
    return counter.scored_steps, out


def test_a_scored_prompt_under_load_advances_by_its_share_of_the_budget(llm, prompt, alone, monkeypatch):
    steps_alone, out_alone = alone
    assert steps_alone <= math.ceil(PROMPT_LEN / BUDGET) + 2
    decodes = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(NUM_DECODES)]
    counter = StepCounter(llm.engine, monkeypatch)
    before = num_backend_compilations()
    outs = llm.generate([*decodes, prompt], [DECODE] * NUM_DECODES + [SCORED], use_tqdm=False)
    assert num_backend_compilations() == before  # every shape was declared and compiled at start-up
    assert all(len(o.outputs[0].token_ids) == DECODE.max_tokens for o in outs[:-1])
    assert counter.scored_finished_first()  # the load lasted the whole time it was scored
    assert counter.scored_steps <= min(5 * steps_alone, _share_bound()), (counter.scored_steps, steps_alone)
    scored = outs[-1]
    _assert_same_scores(scored.prompt_logprobs, out_alone.prompt_logprobs)
    assert scored.outputs[0].token_ids == out_alone.outputs[0].token_ids


def test_echo_with_logprobs_on_the_server_under_load(llm, prompt, alone, monkeypatch):
    """The same through the OpenAI server (in-process, over the same engine): a completion of the
    prompt as token ids with echo, logprobs 2 and max_tokens 2, beside 19 decoding requests."""
    import aiohttp
    from aiohttp import web

    from entrypoints.openai.api_server import OpenAIServer, ServerConfig

    steps_alone, out_alone = alone
    counter = StepCounter(llm.engine, monkeypatch)
    scored_body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 0}

    async def main():
        server = OpenAIServer(llm.engine, ServerConfig(port=0))
        server.async_engine.start()
        runner = server.make_runner()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                async def post(payload):
                    async with session.post("/v1/completions", json=payload) as response:
                        assert response.status == 200, await response.text()
                        return await response.json()

                # Twice the offline decodes' tokens: slack for the scored request's way in.
                decodes = [asyncio.create_task(post({"prompt": [5 + i, 6, 7, 8, 9, 10, 11, 12], "temperature": 0,
                                                     "max_tokens": 2 * DECODE.max_tokens, "ignore_eos": True}))
                           for i in range(NUM_DECODES)]
                for _ in range(3000):  # until every decode has joined
                    if server.async_engine.stats().num_running == NUM_DECODES:
                        break
                    await asyncio.sleep(0.01)
                scored = await post(scored_body)
                await asyncio.gather(*decodes)
                return scored
        finally:
            await server.async_engine.shutdown()
            await runner.cleanup()

    before = num_backend_compilations()
    body = asyncio.run(main())
    assert num_backend_compilations() == before
    assert counter.scored_finished_first()  # all 19 decodes ran the whole time it was scored
    assert counter.scored_steps <= min(5 * steps_alone, _share_bound()), (counter.scored_steps, steps_alone)
    got = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got) == PROMPT_LEN + 2 and got[0] is None
    want = [out_alone.prompt_logprobs[pos][prompt[pos]] for pos in range(1, PROMPT_LEN)]
    assert all(abs(g - w) < 1e-4 for g, w in zip(got[1:PROMPT_LEN], want, strict=True))
