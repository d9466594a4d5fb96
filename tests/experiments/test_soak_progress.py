"""The soak's progress check (experiments/bench/soak_progress.py), on hand-made latencies: no
server. A starved request is caught and named; requests slow for their size are not; a class too
small borrows a coarser one; the floor keeps queueing from counting as starvation; bad arguments
are refused by name."""

import random

import pytest

from experiments.bench.soak_progress import Sample, check_progress


def _run(seed=0):
    """A run with three sizes of request, each in line with its class: short (about 1 s), long
    outputs (about 10 s), scored long prompts (about 4 s)."""
    rng = random.Random(seed)
    samples = []
    for i in range(40):
        samples.append(Sample(rng.uniform(0.8, 1.6), 20, 16, label=f"short{i}"))
        samples.append(Sample(rng.uniform(8, 14), 20, 200, n=3, label=f"long{i}"))
        samples.append(Sample(rng.uniform(3, 6), 720, 2, scored=True, label=f"scored{i}"))
    return samples


def test_a_run_in_line_with_its_classes_passes():
    report = check_progress(_run(), max_ratio=3.0)
    assert report.passed and report.num_checked == 120 and report.num_over == 0
    # Judged by its own class, a long request is not slow, though 10x the short ones.
    assert report.worst_ratio < 2.0, report.summary()


def test_a_starved_request_fails_the_run_and_is_named():
    samples = _run() + [Sample(300.0, 787, 2, scored=True, label="the 787-token echo")]
    report = check_progress(samples, max_ratio=8.0)
    assert not report.passed and report.num_over == 1
    assert report.worst.label == "the 787-token echo"
    # Its class is the scored long prompts (512-1023 prompt tokens, 2 generated): median ~4.5 s.
    assert 3 < report.worst_median < 6 and report.worst_ratio == pytest.approx(300 / report.worst_median)
    assert "prompt tokens 512-1023" in report.worst_class and "scored" in report.worst_class
    assert "the 787-token echo" in report.summary() and report.top[0][1] == "the 787-token echo"
    assert report.worst_by_label["the 787-token echo"] == round(report.worst_ratio, 3)
    assert report.worst_by_label["short0"] < 2  # every label's highest ratio


def test_a_class_too_small_borrows_the_next_coarser():
    # One request with a 100-token prompt and 16 generated: its own class has one member, so it
    # is held to (generated 16-31, n=1, not scored), the short requests (median ~1.2 s).
    samples = _run() + [Sample(1.4, 100, 16, label="alone")]
    report = check_progress(samples, max_ratio=3.0, min_class_size=5)
    assert report.passed
    alone = check_progress([s for s in samples if s.label.startswith(("short", "alone"))] +
                           [Sample(30.0, 100, 16, label="stuck alone")], max_ratio=8.0)
    assert alone.worst.label == "stuck alone" and "generated tokens 16-31" in alone.worst_class
    assert "prompt tokens" not in alone.worst_class


def test_the_floor_keeps_queueing_from_looking_like_starvation():
    # Most requests wait ~4 s for a seat; one-token requests are fast when they get one at once
    # (median 0.1 s) and one of them waited like the rest: not starved, thanks to the floor.
    samples = [Sample(4.0 + 0.01 * i, 30, 40, label=f"busy{i}") for i in range(50)]
    samples += [Sample(0.1, 5, 1, label=f"tiny{i}") for i in range(9)] + [Sample(3.0, 5, 1, label="tiny waited")]
    assert check_progress(samples, max_ratio=8.0, floor=0.5).passed
    without = check_progress(samples, max_ratio=8.0, floor=0.0)
    assert not without.passed and without.worst.label == "tiny waited" and without.worst_ratio == pytest.approx(30.0)


def test_nothing_to_check_and_bad_arguments():
    assert check_progress([]).passed and check_progress([]).worst is None
    with pytest.raises(ValueError, match="max_ratio must be > 1"):
        check_progress(_run(), max_ratio=1.0)
    with pytest.raises(ValueError, match="min_class_size"):
        check_progress(_run(), min_class_size=0)
    with pytest.raises(ValueError, match="floor must be in"):
        check_progress(_run(), floor=2.0)
    with pytest.raises(ValueError, match="n >= 1"):
        check_progress([Sample(1.0, 10, 10, n=0)])


def test_min_seconds_holds_fast_runs_to_a_floor():
    # Sub-second latencies on a busy machine: one slow step makes a 0.6 s request 6x its class.
    samples = [Sample(0.1, 10, 8, label=f"fast{i}") for i in range(20)] + [Sample(0.6, 10, 8, label="one slow step")]
    assert not check_progress(samples, max_ratio=4.0).passed
    report = check_progress(samples, max_ratio=4.0, min_seconds=1.0)
    assert report.passed and report.worst.label == "one slow step" and report.worst_ratio == pytest.approx(0.6)
    assert not check_progress(samples + [Sample(30.0, 10, 8, label="starved")], max_ratio=4.0, min_seconds=1.0).passed
    with pytest.raises(ValueError, match="min_seconds must be >= 0"):
        check_progress(samples, min_seconds=-1.0)
