"""The pipeline simulation reproduces the bubble formula and the in-flight micro-batches of GPipe and 1F1B, and
is the schedule the lab's hand-written pipeline runs (labkit.byhand.pipeline_parallel)."""
from __future__ import annotations

import pytest

from labkit.byhand.pipeline_parallel import programs
from labkit.errors import LabkitError
from labkit.course.pipeline_sim import bubble_fraction, peak_in_flight, pipeline_schedule, simulated_bubble


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
    with pytest.raises(LabkitError):
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_simulation_orders_passes_as_the_real_pipeline_does(schedule):
    for p, m in ((p, m) for p in (2, 3, 4) for m in range(1, 9)):
        events = pipeline_schedule(p, m, schedule)
        for stage, program in programs(schedule, m, p).items():
            simulated = [(e["kind"], e["micro"]) for e in sorted(events, key=lambda e: e["start"]) if e["stage"] == stage]
            assert simulated == [(a, j) for a, j in program if a in ("F", "B")], (p, stage, m)


def test_stages_of_unequal_cost_idle_the_cheaper_one():
    """Stage 1 twice as slow as stage 0 (2 stages, GPipe, m = 4, B = 2F): stage 1 is busy 4·2 + 4·4 = 24 units from
    t = 1 (stage 0's first forward) without a gap, so the step ends at 25 + 2 (stage 0's last backward) = 27; stage 0
    works 4 + 8 = 12 of those 27 units."""
    ev = pipeline_schedule(2, 4, "gpipe", t_forward=[1.0, 2.0], t_backward=[2.0, 4.0])
    end = max(e["end"] for e in ev)
    busy0 = sum(e["end"] - e["start"] for e in ev if e["stage"] == 0)
    assert end == 27.0 and busy0 == 12.0
