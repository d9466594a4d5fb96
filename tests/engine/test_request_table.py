"""The runner's request table and multi-position results, on random:tiny: what crosses to the
device per step, penalties computed from device-side counts (also after preemption), and logits
sampled at several positions of one row."""

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling_params import SamplingParams
from engine.step.step_inputs import StepLayout
from models.llama import forward_dense
from tests.engine.conftest import run_to_completion, scheduler_as


def _old_layout_bytes(t: int, s: int, max_blocks_per_seq: int, max_model_len: int) -> int:
    """The flat buffer of the previous design (commit 0f770cd, engine/step/step_inputs.py):
    attention fields, nine per-row sampling arrays, flags, and the penalty history int32[S,
    max_model_len]."""
    ints = 3 * t + (s + 1) + s + s * max_blocks_per_seq + s + 1 + 9 * s + s * max_model_len + 4
    return 4 * ints


def test_host_to_device_bytes_per_decode_step_at_the_defaults():
    # Defaults: 32 sequences, max_model_len 4096, block_size 16; the 32-token decode bucket.
    # The default model's vocabulary: a step with a constrained row also sends token_mask
    # [L, ceil(V / 32)], a separate argument; the flat buffer carries no mask bytes.
    layout = StepLayout(32, 32, 32, max_blocks_per_seq=4096 // 16, mask_words=-(-49152 // 32))
    new = 4 * layout.size
    old = _old_layout_bytes(32, 32, 4096 // 16, 4096)
    assert new * 10 <= old, (new, old)


def test_one_transfer_per_step_and_none_sized_by_history(tiny_engine, monkeypatch):
    engine = tiny_engine
    sent = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: (sent.append(np.asarray(x).nbytes),
                                                                real_put(x, *a, **k))[1])
    params = SamplingParams(temperature=0.7, seed=1, frequency_penalty=0.5, repetition_penalty=1.2,
                            max_tokens=6, ignore_eos=True)
    engine.add_request("pen", list(range(2, 42)), params)  # one 40-token prefill step
    engine.step()  # prefill: the request joins (its history is written once, outside the step)
    sent.clear()
    for _ in range(4):
        engine.step()
    layout = engine.runner._layout(engine.runner.shapes.bucket_for(1, 1))
    assert sent == [4 * layout.size] * 4  # decode steps: only the bucket's flat buffer
    run_to_completion(engine, [])
    # A constrained request's steps also send the token mask, [L, ceil(V / 32)] int32.
    from engine.structured_params import StructuredOutputsParams

    so = SamplingParams(temperature=0.7, seed=1, max_tokens=3,
                        structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    engine.add_request("masked", list(range(2, 42)), so)
    engine.step()
    sent.clear()
    engine.step()
    assert sent == [4 * layout.size, layout.mask.nbytes]
    run_to_completion(engine, [])


def _reference_with_penalties(params_tree, config, prompt, n, presence, frequency, repetition):
    """Greedy decoding with vLLM's penalties, computed on the host from the dense forward."""
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))
    seq, out = list(prompt), []
    for _ in range(n):
        padded = np.zeros(-(-len(seq) // 64) * 64, np.int32)
        padded[: len(seq)] = seq
        logits = np.asarray(forward(params_tree, jnp.asarray(padded)))[len(seq) - 1].astype(np.float64)
        counts = np.bincount(out, minlength=logits.shape[0]) if out else np.zeros(logits.shape[0])
        seen = counts > 0
        seen[list(prompt)] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        token = int(np.argmax(logits))
        seq.append(token)
        out.append(token)
    return out


def test_penalties_from_the_table_match_a_host_reference_also_after_preemption(tiny_engine):
    engine = tiny_engine
    prompts = [[(13 * i + 5 * k) % 250 + 3 for k in range(60 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.6, repetition_penalty=1.3)
    want = [_reference_with_penalties(engine.runner.params, engine.model_config, p, 24, 0.4, 0.6, 1.3)
            for p in prompts]
    alone = run_to_completion(engine, [("alone", prompts[0], params)])["alone"].outputs[0].token_ids
    assert alone == want[0]
    # A pool of 16 blocks (16 tokens each) cannot hold four requests of 84-93 tokens: some are
    # preempted, and their penalty state is rebuilt from their history when they resume.
    with scheduler_as(engine, num_kv_blocks=17, enable_prefix_caching=False) as sched:
        outs = run_to_completion(engine, [(f"p{i}", p, params) for i, p in enumerate(prompts)])
        assert sched.stats.num_preemptions > 0
    assert [outs[f"p{i}"].outputs[0].token_ids for i in range(4)] == want


def test_logits_at_several_positions_of_one_row(tiny_engine):
    engine = tiny_engine
    runner = engine.runner
    prompt = [(11 * k + 7) % 250 + 3 for k in range(12)]
    with scheduler_as(engine, enable_prefix_caching=False) as sched:
        engine.add_request("multi", prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2,
                                                           ignore_eos=True))
        out = sched.schedule()
        (sr,) = out.scheduled
        sr.num_logits = 4  # sample at the last 4 prompt positions
        result = runner.execute(out)
        sched.discard_step(out)
        engine.abort_request("multi")
    logits = np.asarray(forward_dense(runner.params, engine.model_config, jnp.asarray(prompt)))
    assert result.req_ids == ["multi"]
    assert result.sampled_token_ids == [np.argmax(logits[-4:], axis=-1).tolist()]
    (lps,) = result.logprobs
    ref = jax.nn.log_softmax(logits[-4:], axis=-1)
    for lp, row in zip(lps, np.asarray(ref)):
        assert abs(lp.logprob - row.max()) < 1e-4 and lp.top_token_ids[0] == int(row.argmax())
    run_to_completion(engine, [])
