"""Property tests: random configs and random sequences of add / abort / step.

A fake paged model stands in for the engine: it writes each fed token into its KV slot
(block_ids[p // block_size] * block_size + p % block_size) and "attends" by reading positions
0..n-1 back through the block table; its next token is a function of that sequence. So a wrong
block table, a prefix hit on an evicted or unfinished block, or a write into a shared block shows
up as a wrong output, and every finished request must match the same request run alone.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from scheduler import FinishReason, Request, Scheduler, SchedulerConfig, StepResult

EOS = 7
STOP = 11


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq) * 17) % 48 + 1


class FakePagedModel:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.slots: list[int | None] = [None] * (config.num_blocks * config.block_size)

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def step(self, output) -> StepResult:
        for sr in output.scheduled:
            for i, token in enumerate(sr.token_ids):
                self.slots[self._slot(sr.block_ids, sr.num_computed_tokens + i)] = token
        req_ids, tokens = [], []
        for sr in output.scheduled:
            if sr.sample:
                n = sr.num_computed_tokens + sr.num_scheduled_tokens
                seq = [self.slots[self._slot(sr.block_ids, p)] for p in range(n)]
                req_ids.append(sr.req_id)
                tokens.append([next_token(seq)])
        return StepResult(req_ids, tokens)


def run_alone(request: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    """The reference: what the request outputs with nobody else around."""
    seq, out = list(request.prompt_token_ids), []
    while True:
        token = next_token(seq)
        seq.append(token)
        out.append(token)
        if (token == EOS and not request.ignore_eos) or token in request.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) >= request.max_tokens or len(seq) >= max_model_len:
            return out, FinishReason.LENGTH


@st.composite
def configs(draw, tight: bool = False) -> SchedulerConfig:
    """Random valid configs; `tight` ones are paged, with a pool barely over one long request."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    min_blocks = -(-max_model_len // block_size) + 1
    max_num_seqs = draw(st.integers(1, 6) if not tight else st.integers(2, 6))
    chunked = draw(st.booleans())
    min_budget = max(max_num_seqs, 1 if chunked else max_model_len)
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(min_budget, min_budget + 48)),
        max_model_len=max_model_len,
        block_size=block_size,
        # From one max_model_len request's worth (preemption, eviction) to a roomy pool.
        num_blocks=draw(st.integers(min_blocks, min_blocks + 3 if tight else 3 * min_blocks)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority", "static"])),
        kv_allocation="paged" if tight else draw(st.sampled_from(["paged", "contiguous"])),
    )


def ops(tight: bool = False):
    """Random op lists; `tight` ones add longer requests, so decodes outgrow the pool."""
    add = st.tuples(
        st.just("add"),
        st.integers(4, 63) if tight else st.integers(1, 63),  # prompt length (clipped)
        st.integers(8, 24) if tight else st.integers(1, 24),  # max_tokens
        st.integers(0, 2),  # prompt family: same family, shared prefix
        st.integers(0, 2),  # priority
        st.booleans(),  # ignore_eos
    )
    abort = st.tuples(st.just("abort"), st.integers(0, 40))
    # A step, sometimes with an abort between schedule() and update().
    step = st.tuples(st.just("step"), st.none() | st.none() | st.none() | st.integers(0, 40))
    return st.lists(
        st.one_of(add, add, add, abort, step, step, step, step), min_size=8, max_size=80
    )


def checked_step(scheduler, model, check_invariants, abort_in_flight=None) -> list:
    config = scheduler.config
    running_before = set(scheduler.running)
    output = scheduler.schedule()
    ids = [sr.req_id for sr in output.scheduled]
    assert len(ids) == len(set(ids)) <= config.max_num_seqs
    assert output.num_batched_tokens == sum(sr.num_scheduled_tokens for sr in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert not set(ids) & set(output.preempted_req_ids)
    if config.policy == "static" and running_before:
        assert set(ids) <= running_before, "static admitted a newcomer while its batch ran"
    for sr in output.scheduled:
        request = scheduler.get_request(sr.req_id)
        end = sr.num_computed_tokens + sr.num_scheduled_tokens
        assert sr.num_scheduled_tokens > 0 and sr.num_computed_tokens == request.num_computed_tokens
        assert sr.token_ids == request.all_token_ids[sr.num_computed_tokens : end]
        assert sr.sample == (end == request.num_tokens)
        assert 0 not in sr.block_ids and len(sr.block_ids) * config.block_size >= end
    result = model.step(output)
    if abort_in_flight is not None:
        scheduler.abort_request(abort_in_flight)
    finished = scheduler.update(output, result)
    check_invariants(scheduler)
    return finished


SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(config=configs(), ops=ops())
def test_random_add_abort_step(config, ops, check_invariants):
    drive(config, ops, check_invariants)


@SETTINGS
@given(config=configs(tight=True), ops=ops(tight=True))
def test_random_add_abort_step_under_block_pressure(config, ops, check_invariants):
    drive(config, ops, check_invariants)


def drive(config, ops, check_invariants) -> None:
    """Apply `ops`, checking invariants after each, then drain and compare with run_alone."""
    scheduler = Scheduler(config)
    model = FakePagedModel(config)
    added: list[Request] = []
    finished: dict[str, Request] = {}
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, family, priority, ignore_eos = op
            prompt_len = min(prompt_len, config.max_model_len - 1)
            request = Request(
                f"r{len(added)}",
                [100 * family + i % 40 for i in range(prompt_len)],
                max_tokens,
                eos_token_id=EOS,
                stop_token_ids=(STOP,) if family == 1 else (),
                ignore_eos=ignore_eos,
                priority=priority,
                arrival_time=float(len(added)),
            )
            scheduler.add_request(request)
            added.append(request)
        elif op[0] == "abort":
            if added:
                scheduler.abort_request(added[op[1] % len(added)].req_id)
        else:
            victim = added[op[1] % len(added)].req_id if added and op[1] is not None else None
            for request in checked_step(scheduler, model, check_invariants, victim):
                finished[request.req_id] = request
        check_invariants(scheduler)

    # Arrivals stop: everything left finishes within a bound (no livelock under preemption).
    work = sum(r.num_tokens + r.max_tokens for r in added if not r.is_finished)
    bound = 3 * work + 20
    steps = 0
    while scheduler.has_unfinished_requests():
        for request in checked_step(scheduler, model, check_invariants):
            finished[request.req_id] = request
        steps += 1
        assert steps <= bound, f"not finished after {steps} steps: {scheduler.stats}"

    # Steer generation toward the interesting paths (preemption, eviction, prefix hits).
    stats = scheduler.stats
    target(float(stats.num_preemptions), label="preemptions")
    target(float(stats.num_evictions + stats.prefix_cache_hits), label="evictions and hits")
    pool = scheduler.kv_cache_manager.pool
    assert all(count == 0 for count in pool.ref_cnt) and pool.num_used_blocks == 0
    assert not scheduler.kv_cache_manager.block_tables
    for request in added:
        expected, reason = run_alone(request, config.max_model_len)
        if request.req_id in finished:
            assert request.output_token_ids == expected and request.finish_reason is reason
        else:
            assert request.finish_reason is FinishReason.ABORT
            assert request.output_token_ids == expected[: request.num_output_tokens]
    assert all(r.is_finished and r.finish_reason is not None for r in added)
