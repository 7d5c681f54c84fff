"""Notebook 06c's calibration cache: reused only while newer than the bench and every module it checks; the modules
it names exist (a package reorganisation would otherwise leave it checking nothing); the plot and the bench's table
read a result of the bench's shape."""
import os

import pytest

from labkit.course import calibration as cal
from labkit.errors import LabkitError


def _touch(path, mtime):
    path.write_text("x")
    os.utime(path, (mtime, mtime))
    return path


def test_every_source_exists_and_the_bench_is_among_them():
    paths = cal.sources()
    assert cal.BENCH in paths and len(paths) == 1 + len(cal.DEPENDS_ON)


def test_a_missing_source_is_named(monkeypatch):
    monkeypatch.setattr(cal, "DEPENDS_ON", ("labkit/plan.py",))  # the path before the package was reorganised
    with pytest.raises(LabkitError, match="labkit/plan.py"):
        cal.sources()


def test_fresh_only_when_newer_than_every_source(tmp_path):
    deps = [_touch(tmp_path / "a.py", 1000), _touch(tmp_path / "b.py", 2000)]
    cache = tmp_path / "plan_calibration.json"
    assert not cal.is_fresh(cache, deps), "no cache: not fresh"
    _touch(cache, 1500)
    assert not cal.is_fresh(cache, deps), "older than b.py: stale"
    os.utime(cache, (2500, 2500))
    assert cal.is_fresh(cache, deps)


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
