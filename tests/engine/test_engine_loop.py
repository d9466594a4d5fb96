"""The engine loop on a fake runner (LLMEngine.from_parts): outputs, n > 1, stops, aborts,
preemption, a step that fails (all-or-nothing), and scheduler knobs changed through one method."""

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from scheduler import Scheduler, SchedulerConfig
from tests.engine.conftest import run_to_completion
from tests.engine.fake_runner import FakeRunner, expected_output
from text.byte_tokenizer import ByteTokenizer

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(num_blocks: int = 200, **knobs) -> tuple[LLMEngine, FakeRunner]:
    fields = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                  num_blocks=num_blocks)
    fields.update(knobs)
    runner = FakeRunner(VOCAB)
    config = EngineConfig(model="fake", max_num_seqs=fields["max_num_seqs"],
                          max_num_batched_tokens=fields["max_num_batched_tokens"],
                          max_model_len=fields["max_model_len"], block_size=fields["block_size"],
                          num_kv_blocks=num_blocks)
    engine = LLMEngine.from_parts(config, scheduler=Scheduler(SchedulerConfig(**fields)),
                                  runner=runner, tokenizer=ByteTokenizer(VOCAB))
    return engine, runner


def prompt(i: int, n: int = 10) -> list[int]:
    return [(7 * i + 3 * k) % 200 + 2 for k in range(n)]


def assert_no_leak(engine: LLMEngine) -> None:
    stats = engine.scheduler.stats
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished_requests()


def test_outputs_equal_the_hand_computed_ones_alone_and_batched():
    engine, _ = make_engine()
    outs = run_to_completion(engine, [(f"r{i}", prompt(i, 5 + i), GREEDY) for i in range(12)])
    for i in range(12):
        assert outs[f"r{i}"].outputs[0].token_ids == expected_output(prompt(i, 5 + i), 12, VOCAB)
        assert outs[f"r{i}"].outputs[0].logprobs is None
    assert_no_leak(engine)


def test_preemption_and_prefix_caching_keep_outputs_exact():
    engine, runner = make_engine(num_blocks=34, max_model_len=64)  # 33 blocks of 4: preemption
    shared = prompt(99, 16)
    requests = [(f"p{i}", shared + prompt(i, 6), SamplingParams(temperature=0.0, max_tokens=30,
                                                                 ignore_eos=True)) for i in range(6)]
    outs = run_to_completion(engine, requests)
    assert engine.get_stats().num_preemptions > 0
    for rid, p, _ in requests:
        assert outs[rid].outputs[0].token_ids == expected_output(p, 30, VOCAB)
    # The last finish reaches the runner with the next schedule(), even an empty one.
    assert engine.step() == [] and not runner.fed
    assert_no_leak(engine)


def test_n_stop_ids_max_tokens_and_logprobs_through_the_loop():
    engine, _ = make_engine()
    p = prompt(3)
    want = expected_output(p, 12, VOCAB)
    outs = run_to_completion(engine, [
        ("n", p, SamplingParams(n=3, temperature=0.0, max_tokens=5, ignore_eos=True)),
        ("stop", p, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[want[3]])),
        ("lp", p, SamplingParams(temperature=0.0, max_tokens=2, logprobs=1)),
    ])
    assert [o.token_ids for o in outs["n"].outputs] == [want[:5]] * 3
    stop = outs["stop"].outputs[0]
    assert stop.token_ids == want[:4] and stop.finish_reason == "stop" and stop.stop_reason == want[3]
    assert outs["lp"].outputs[0].logprobs == [{want[0]: -0.5}, {want[1]: -0.5}]
    assert_no_leak(engine)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on():
    engine, runner = make_engine()
    engine.add_request("a", prompt(1), GREEDY)
    engine.add_request("b", prompt(2), GREEDY)
    engine.step()
    runner.fail_at_step = runner.num_steps + 1
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    for out in failed:
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert "injected fault" in out.outputs[0].error
    assert engine.get_stats().num_failed_steps == 1 and engine.dead_reason is None
    outs = run_to_completion(engine, [("c", prompt(3), GREEDY)])
    assert outs["c"].outputs[0].token_ids == expected_output(prompt(3), 12, VOCAB)
    assert_no_leak(engine)


def test_a_runner_that_lost_its_state_marks_the_engine_dead():
    engine, runner = make_engine()
    engine.add_request("a", prompt(1), GREEDY)
    runner.fail_at_step = 1
    runner.healthy = False
    engine.step()
    assert "lost its device state" in engine.dead_reason
    from engine.core.llm_engine import EngineDeadError

    with pytest.raises(EngineDeadError):
        engine.add_request("b", prompt(2), GREEDY)
    with pytest.raises(EngineDeadError):
        engine.step()


def test_reconfigure_scheduler_is_validated_and_keeps_config_current():
    engine, _ = make_engine()
    scheduler = engine.reconfigure_scheduler(enable_prefix_caching=False, max_num_batched_tokens=32)
    assert engine.scheduler is scheduler and scheduler.config.max_num_batched_tokens == 32
    assert engine.config.max_num_batched_tokens == 32 and not engine.config.enable_prefix_caching
    with pytest.raises(ValueError, match="block_size"):
        engine.reconfigure_scheduler(block_size=8)
    engine.add_request("busy", prompt(1), GREEDY)
    with pytest.raises(ValueError, match="idle"):
        engine.reconfigure_scheduler(policy="priority")
    engine.abort_request("busy")
    engine.reconfigure_scheduler(policy="priority")
    assert engine.scheduler.config.policy == "priority"


def test_reconfigure_hands_the_last_finishes_to_the_runner():
    engine, runner = make_engine()
    run_to_completion(engine, [("a", prompt(1), GREEDY)])
    assert "a" in runner.fed  # its finish is reported with the next schedule()
    engine.reconfigure_scheduler(enable_prefix_caching=False)
    assert not runner.fed


def test_a_malformed_runner_result_fails_the_step_not_the_engine():
    engine, runner = make_engine()
    engine.add_request("a", prompt(1), GREEDY)
    real_execute = runner.execute
    runner.execute = lambda out: dataclasses.replace(real_execute(out), sampled_token_ids=[[]])
    (failed,) = engine.step()
    assert failed.outputs[0].finish_reason == "abort" and "num_logits" in failed.outputs[0].error
    runner.execute = real_execute
    outs = run_to_completion(engine, [("b", prompt(2), GREEDY)])
    assert outs["b"].outputs[0].token_ids == expected_output(prompt(2), 12, VOCAB)
    assert_no_leak(engine)
