"""The planner's context-parallel memory line against the memory probe's by-hand cp workers (labkit.course.cp_lab):
what a cp2 worker saves against one card at the probe's sequence, measured from MindSpore's pool peaks, and the
planner's activation line (flash attention, as mindformers requires for cp) plus the named term for what the
by-hand attention materialises instead, within the planner calibration's target. The probe's launches are the
ones notebooks 06a and 06d read (cached under runs/parallel_lab/memory)."""
from __future__ import annotations

import pytest

from labkit.byhand import context_parallel as cpl
from labkit.byhand import runs
from labkit.course import cp_lab, parallel_lab
from labkit.course.calibration import bench_module

pytestmark = pytest.mark.slow


def test_the_named_term_counts_the_blocks_each_worker_computes():
    """One card: a x s x s scores per sequence; a ring worker the zigzag's 2cp+1 blocks of (s/2cp)²; a Ulysses
    worker a/cp heads of s x s: at cp 2 a ring worker materialises 5/16 of one card's scores, a Ulysses one half."""
    by = {lay.name: lay for lay in runs.MEMORY_LAYOUTS}
    scores = {n: cp_lab.materialised_attention(by[n])["scores"] for n in ("single", "cp2_ring", "cp2_ulysses")}
    assert scores["cp2_ring"] / scores["single"] == cpl.work(2)[0] / 16
    assert scores["cp2_ulysses"] / scores["single"] == 1 / 2
    s, cfg = runs.MEMORY_SETTINGS, runs.model_cfg()
    assert scores["single"] == 4 * cfg.num_layers * cfg.num_heads * s["global_batch"] * s["seq_len"] ** 2


def test_the_planners_cp_line_with_the_named_term_matches_the_measured_saving():
    rows = cp_lab.cp_memory(parallel_lab.memory_runs("auto"))
    target = bench_module().TARGET
    for r in rows:
        print(f"{r['layout']}: measured {r['measured MiB']:.0f} MiB saved; planner {r['planner (flash) MiB']:.1f} "
              f"({r['error before']:+.1%}), + materialised attention {r['materialised attention MiB']:.1f} = "
              f"{r['planner + named MiB']:.1f} ({r['error after']:+.1%})")
        assert r["measured MiB"] > 0 and r["materialised attention MiB"] > 0
        assert abs(r["error after"]) <= target, r
