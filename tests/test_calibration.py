"""Notebook 06c's calibration cache: reused only while its key (labkit.sources) is today's, that is while the bench
and every labkit module it imports are unchanged; the plot and the bench's table read a result of the bench's
shape."""
import pytest

from labkit import sources
from labkit.course import calibration as cal
from labkit.errors import LabkitError


def test_the_key_covers_the_modules_the_bench_imports_and_the_planners_data():
    deps = {p.relative_to(sources.ROOT).as_posix() for p in sources.dependencies(cal.BENCH)}
    # imported by the bench inside its functions, and by those modules in turn
    assert {"bench/plan_calibration.py", "labkit/parallel/memory.py", "labkit/parallel/planner.py",
            "labkit/model/llama.py", "labkit/config.py", "labkit/training/metrics.py"} <= deps
    assert "labkit/course/calibration.py" not in deps  # what reads the result is not what made it
    assert all((sources.ROOT / d).exists() for d in cal.DATA)


def test_fresh_only_while_the_stored_key_is_todays(tmp_path, monkeypatch):
    cache = tmp_path / "plan_calibration.json"
    monkeypatch.setattr(cal, "key", lambda: "today")
    assert not cal.is_fresh(cache), "no cache: not fresh"
    cache.write_text("{}")
    assert not cal.is_fresh(cache), "a result without a key (the bench run by hand): not fresh"
    sources.stamp(cal.key_file(cache), "yesterday")
    assert not cal.is_fresh(cache), "made from other sources: stale"
    sources.stamp(cal.key_file(cache), "today")
    assert cal.is_fresh(cache)


def test_modes(tmp_path):
    result, why = cal.calibration("skip")
    assert result is None and why.startswith("calibration skipped")
    assert cal.calibration("cached", cache=tmp_path / "none.json")[0] is None
    with pytest.raises(LabkitError, match="not known"):
        cal.calibration("sometimes")
    cache = tmp_path / "c.json"
    cache.write_text('{"ok": true}')
    assert cal.calibration("cached", cache=cache)[0] == {"ok": True}


def test_plot_and_table_read_the_bench_result():
    import matplotlib

    matplotlib.use("Agg")
    bench = cal.bench_module()
    pair = lambda m, p: {"measured": m, "predicted": p, "error": (p - m) / m}  # noqa: E731
    diffs = [{"comparison": "batch 4 -> 8", "pool_mb": pair(40.0, 42.0), "rss_mb": pair(90.0, 45.0),
              "step_cpu_s": pair(0.1, 0.08)}]
    result = {"target": bench.TARGET, "differences": diffs, "configs": {}, "notes": [],
              "summary": {"pool_max_abs_error": 0.05, "pool_meets_target": True, "rss_max_abs_error": 0.5,
                          "rss_meets_target": False}}
    ax = cal.plot_calibration(result)
    assert [t.get_text() for t in ax.texts] == ["batch 4 -> 8"]
    assert "batch 4 -> 8" in bench.table(result)
