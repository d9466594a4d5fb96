"""Loaders: a truncated ShareGPT file, Azure and Mooncake traces, random and shared-prefix."""

import itertools
import json

import numpy as np
import pytest

from experiments.lab import datasets


def _conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _words(n, word="w"):
    return " ".join(f"{word}{i}" for i in range(n))


def _write_truncated(path, records, cut_chars):
    text = json.dumps(records, indent=2)
    path.write_text(text[: len(text) - cut_chars])
    return text


def test_iter_json_array_stops_at_the_cut_record(tmp_path):
    records = [{"id": i, "text": "x" * (7 * i)} for i in range(6)]
    full = json.dumps(records, indent=2)
    cut = full.index('"id": 5') + 3  # inside the last record
    path = tmp_path / "cut.json"
    path.write_text(full[:cut])
    for chunk in (8, 64, 1 << 20):  # refills mid-record, and the whole file at once
        assert list(datasets.iter_json_array(path, chunk_chars=chunk)) == records[:5]
    path.write_text(full)
    assert list(datasets.iter_json_array(path, chunk_chars=5)) == records
    path.write_text("[1, 22, 333")  # a number cut at the end of the file is dropped
    assert list(datasets.iter_json_array(path, chunk_chars=2)) == [1, 22]
    path.write_text('{"not": "an array"}')
    with pytest.raises(ValueError):
        list(datasets.iter_json_array(path))


def test_load_sharegpt_filters_like_vllm_and_skips_the_cut_record(tmp_path, tokenizer):
    good = [_conv(("human", _words(5, f"q{i}_")), ("gpt", _words(6 + i))) for i in range(3)]
    records = good + [
        _conv(("human", "too short"), ("gpt", _words(10))),  # prompt < 4 tokens
        _conv(("human", _words(5)), ("gpt", "short answer")),  # output < 4 tokens
        _conv(("human", _words(50)), ("gpt", _words(10))),  # prompt > max_prompt_len
        _conv(("human", _words(10)), ("gpt", _words(60))),  # prompt + output > max_total_len
        _conv(("gpt", "hello there"), ("human", _words(4, "late")), ("gpt", _words(8))),
        _conv(("human", _words(6, "cut")), ("gpt", _words(9))),  # truncated below
    ]
    path = tmp_path / "sharegpt.json"
    _write_truncated(path, records, cut_chars=40)
    samples = datasets.load_sharegpt(tokenizer, 4, path=path, max_prompt_len=20, max_total_len=40)
    got = sorted((s.prompt.split()[0], s.prompt_len, s.expected_output_len) for s in samples)
    assert got == [("late0", 4, 8), ("q0_0", 5, 6), ("q1_0", 5, 7), ("q2_0", 5, 8)]
    assert all(s.arrival_offset_s is None for s in samples)
    clipped = datasets.load_sharegpt(tokenizer, 4, path=path, max_prompt_len=20,
                                     max_total_len=40, max_output_len=6)
    assert max(s.expected_output_len for s in clipped) == 6
    with pytest.raises(ValueError, match="only 4 usable"):
        datasets.load_sharegpt(tokenizer, 5, path=path, max_prompt_len=20, max_total_len=40)


def test_packaged_sharegpt_file_reads_record_by_record():
    first = list(itertools.islice(datasets.iter_json_array(datasets.sharegpt_path()), 3))
    assert len(first) == 3 and all("conversations" in r for r in first)


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.4799600,100,300
"""


def test_azure_csv_offsets_lengths_scales_and_caps(tmp_path, tokenizer):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    rows = datasets.read_trace(path)
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.052, 1.5])
    assert [(r.input_len, r.output_len) for r in rows] == [(4808, 10), (3180, 8), (100, 300)]
    samples = datasets.load_trace(path, tokenizer, time_scale=2.0, max_prompt_len=64,
                                  max_output_len=50)
    assert [s.arrival_offset_s for s in samples] == pytest.approx([0.0, 0.104, 3.0])
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == [(64, 10), (64, 8), (64, 50)]
    scaled = datasets.load_trace(path, tokenizer, num_requests=2, length_scale=0.01)
    assert [(s.prompt_len, s.expected_output_len) for s in scaled] == [(48, 1), (32, 1)]


def test_mooncake_equal_hash_ids_give_identical_blocks(tmp_path, tokenizer):
    rows = [
        {"timestamp": 1000, "input_length": 1536, "output_length": 256, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1536, "output_length": 128, "hash_ids": [0, 1, 3]},
        {"timestamp": 4000, "input_length": 1100, "output_length": 64, "hash_ids": [0, 4, 5]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # length_scale 1/128: blocks of 4 tokens, so the prompts are 12, 12 and 9 tokens.
    samples = datasets.load_trace(path, tokenizer, length_scale=1 / 128)
    assert [s.arrival_offset_s for s in samples] == pytest.approx([0.0, 0.5, 3.0])
    assert [s.prompt_len for s in samples] == [12, 12, 9]
    assert [s.expected_output_len for s in samples] == [2, 1, 1]
    a, b, c = (s.prompt.split() for s in samples)
    assert a[:8] == b[:8] and a[8:] != b[8:]  # blocks 0, 1 shared; 2 vs 3 differ
    assert a[:4] == c[:4] and a[4:8] != c[4:8]


def test_random_lengths_fall_in_the_range(tokenizer):
    samples = datasets.load_random(tokenizer, 50, input_len=20, output_len=10, range_ratio=0.5,
                                   seed=3)
    assert all(10 <= s.prompt_len <= 30 and 5 <= s.expected_output_len <= 15 for s in samples)
    assert len({s.prompt_len for s in samples}) > 5
    assert all(len(tokenizer.encode(s.prompt)) == s.prompt_len for s in samples)
    fixed = datasets.load_random(tokenizer, 3, input_len=7, output_len=4)
    assert [(s.prompt_len, s.expected_output_len) for s in fixed] == [(7, 4)] * 3


def test_shared_prefix_has_n_prefixes_times_m_questions(tokenizer):
    samples = datasets.load_shared_prefix(tokenizer, num_prefixes=3, questions_per_prefix=4,
                                          prefix_len=10, question_len=5, output_len=7)
    assert len(samples) == 12 and all(s.prompt_len == 15 for s in samples)
    prefixes = [tuple(s.prompt.split()[:10]) for s in samples]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({s.prompt for s in samples}) == 12
    assert prefixes[:4] != [prefixes[0]] * 4  # shuffled: one prefix's questions interleave


def test_build_samples_dispatches_and_validates(tmp_path, tokenizer):
    opts = datasets.DatasetOptions(dataset="shared-prefix", num_prompts=5, prefix_len=4,
                                   question_len=2)
    assert len(datasets.build_samples(opts, tokenizer)) == 5
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    trace = datasets.DatasetOptions(dataset="trace", trace_path=str(path), num_prompts=2,
                                    max_prompt_len=8)
    assert [s.prompt_len for s in datasets.build_samples(trace, tokenizer)] == [8, 8]
    for bad in ({"dataset": "nope"}, {"dataset": "trace"}, {"num_prompts": 0},
                {"random_range_ratio": 1.0}, {"time_scale": 0.0}):
        with pytest.raises(ValueError):
            datasets.DatasetOptions(**bad)


def test_synthesized_prompt_is_deterministic_per_seed(tokenizer):
    a = datasets.synthesize_prompt(tokenizer, 16, np.random.default_rng(1))
    b = datasets.synthesize_prompt(tokenizer, 16, np.random.default_rng(1))
    assert a == b and len(a.split()) == 16
