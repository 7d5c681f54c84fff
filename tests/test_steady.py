"""The one steady-throughput definition: median step time after the warm-up steps, with its spread."""
from __future__ import annotations

import json

import pytest

from labkit.training.metrics import WARMUP_STEPS, steady, steady_stats, steady_throughput


def rows(times, tokens=1024):
    return [{"step": i + 1, "step_time_s": t, "tokens_per_s": tokens / t, "mfu": 0.1 * 0.25 / t}
            for i, t in enumerate(times)]


# a compile step, four tuning steps (MindSpore's element-wise kernels), then a steady 0.25 s with one stall
TIMES = [20.0, 0.37, 0.36, 0.35, 0.34] + [0.25, 0.26, 0.24, 0.25, 3.0, 0.25, 0.26]


def test_median_after_warmup_ignores_compile_tuning_and_a_stall():
    s = steady_stats(TIMES)
    assert WARMUP_STEPS == 5 and s["n"] == len(TIMES) - 5
    assert s["median"] == 0.25 and s["max"] == 3.0
    assert 0 <= s["rel_iqr"] < 0.1  # the stall moves the max, not the quartiles
    mean = sum(TIMES[5:]) / len(TIMES[5:])
    assert mean > 0.6, "a mean would have been dragged 2.5x by one stall: the reason for the median"


def test_throughput_is_tokens_over_the_median_step_and_every_user_agrees(tmp_path):
    from labkit.launch.compare import steady_throughput as run_throughput

    h = rows(TIMES)
    assert steady_throughput(h)["tokens_per_s"] == pytest.approx(1024 / 0.25)
    assert steady(h, "tokens_per_s") == pytest.approx(1024 / 0.25)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in h))
    assert run_throughput(tmp_path) == pytest.approx(1024 / 0.25)


def test_a_short_run_keeps_what_follows_the_compile_step():
    assert steady_stats([20.0, 0.5, 0.3])["median"] == pytest.approx(0.4)
    assert steady_stats([20.0])["median"] == 20.0
    assert steady_stats([])["median"] is None
