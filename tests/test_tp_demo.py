"""Tensor parallelism by hand on 2 msrun CPU workers matches one process; the pipeline simulation reproduces
the bubble formula and the in-flight micro-batches of GPipe and 1F1B."""
from __future__ import annotations

import pytest

from labkit.course.tp_demo import bubble_fraction, peak_in_flight, pipeline_schedule, run_tp_demo, simulated_bubble


@pytest.mark.slow
def test_tensor_parallel_matches_single_process(tmp_path):
    r = run_tp_demo(2, output_dir=tmp_path)
    assert r["workers"] == 2 and len(r["per_rank"]) == 2
    for block in ("mlp", "attention", "column_allgather"):
        assert r["max_abs_diff"][block] < 1e-5, r["max_abs_diff"]
    rank0 = r["per_rank"][0]
    assert rank0["local_weights"]["w1"] == [88, 64] and rank0["local_weights"]["w2"] == [64, 88]
    assert rank0["max_abs_value"]["mlp"] > 0.1  # the outputs are not trivially zero


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (4, 4), (4, 8), (4, 32), (8, 8)])
def test_bubble_is_p_minus_1_over_m(schedule, p, m):
    ev = pipeline_schedule(p, m, schedule)
    assert len(ev) == 2 * p * m
    assert simulated_bubble(ev) == pytest.approx(bubble_fraction(p, m))
    assert max(e["end"] for e in ev) == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1)(t_f + t_b)


def test_in_flight_micro_batches():
    gpipe, one = pipeline_schedule(4, 8, "gpipe"), pipeline_schedule(4, 8, "1f1b")
    assert [peak_in_flight(gpipe, s) for s in range(4)] == [8, 8, 8, 8]  # GPipe stashes every micro-batch
    assert [peak_in_flight(one, s) for s in range(4)] == [4, 3, 2, 1]  # 1F1B: p - stage
    with pytest.raises(ValueError):
        pipeline_schedule(2, 2, "zero_bubble")


def test_dependencies_respected():
    ev = {(e["kind"], e["stage"], e["micro"]): e for e in pipeline_schedule(3, 5, "1f1b")}
    for (kind, s, k), e in ev.items():
        if kind == "F" and s > 0:
            assert e["start"] >= ev[("F", s - 1, k)]["end"]
        if kind == "B":
            assert e["start"] >= ev[("F", s, k)]["end"]
            if s < 2:
                assert e["start"] >= ev[("B", s + 1, k)]["end"]
