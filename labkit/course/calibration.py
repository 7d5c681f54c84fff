"""Notebook 06c's calibration of the planner: bench/plan_calibration.py's result (about 2 minutes to measure), reused
while the bench and every labkit module it imports are what they were when it was measured (labkit.sources: the key
is stored beside the result, in plan_calibration.json.key).

    result, note = calibration("auto")   # cached when fresh, else measured now
    print(bench_module().table(result))
    plot_calibration(result)             # predicted vs measured differences, with the bench's target band"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from labkit.errors import LabkitError, LabkitFailure
from labkit.paths import ROOT, RUNS
from labkit.sources import source_key, stamp, stamped

BENCH = ROOT / "bench" / "plan_calibration.py"
CACHE = RUNS / "bench" / "plan_calibration.json"  # what `bench/plan_calibration.py --ci` writes
MODES = ("auto", "run", "cached", "skip")
# data the bench's modules read: MindSpore's training-state census (the planner's bytes per element) and the C++
# sources of the fused CPU kernels the model may build
DATA = ("labkit/parallel/state_census.json", "labkit/model/kernels")


def key() -> str:
    """The key (labkit.sources) of today's calibration: the bench, every labkit module it imports, and DATA."""
    return source_key(BENCH, data=DATA)


def key_file(cache: Path) -> Path:
    """Where the key of the result in `cache` is kept: beside it."""
    return cache.with_name(cache.name + ".key")


def is_fresh(cache: Path = CACHE) -> bool:
    """True when `cache` exists and was measured from today's sources (its key file holds `key()`)."""
    return cache.exists() and stamped(key_file(cache), key())


def bench_module():
    """bench/plan_calibration.py as a module (it is a script, not part of the package): TARGET, table(), ..."""
    spec = importlib.util.spec_from_file_location("plan_calibration", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(cwd: Path | None = None, timeout: float = 1200, cache: Path = CACHE) -> dict:
    """Run `bench/plan_calibration.py --ci --json` now (about 2 minutes on 2 cores); it also writes `cache`, and
    the key of the sources it ran beside it (a result the bench wrote when run by hand has none: it is not reused)."""
    sources_key = key()  # the bench imports its modules as it starts: the sources it runs are today's
    proc = subprocess.run([sys.executable, str(BENCH), "--ci", "--json", "--out", str(cache)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or ROOT)
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        result = {"ok": False, "error": f"no JSON on stdout (exit {proc.returncode})"}
    if not result.get("ok"):
        raise LabkitFailure(f"the calibration failed: {result.get('error')}",
                            f"run `python {BENCH.relative_to(ROOT)} --ci` to see it; last lines:\n"
                            f"{proc.stderr[-1500:]}")
    stamp(key_file(cache), sources_key)
    return result


def calibration(mode: str = "auto", *, cache: Path = CACHE, cwd: Path | None = None) -> tuple[dict | None, str]:
    """The calibration result and a line saying where it came from.

    auto: the cache when it is fresh (`is_fresh`), else measured now; run: always measured; cached: the cache
    whatever sources it came from (None without one); skip: None."""
    if mode not in MODES:
        raise LabkitError(f"calibration mode '{mode}' is not known", f"use one of {', '.join(MODES)}")
    if mode == "skip":
        return None, "calibration skipped (calibration = \"skip\"): nothing measured, nothing compared"
    if mode == "run" or (mode == "auto" and not is_fresh(cache)):
        t0 = time.time()
        return measure(cwd, cache=cache), (f"measured now ({time.time() - t0:.0f} s; the cache was missing or made "
                                           "from other sources)")
    if not cache.exists():
        return None, f"no cached calibration at {cache}"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cache.stat().st_mtime))
    state = "its sources unchanged since" if is_fresh(cache) else "made from other sources than today's"
    return json.loads(cache.read_text(encoding="utf-8")), f"cached {cache.name} ({when}, {state})"


def plot_calibration(result: dict, ax=None):
    """Predicted vs measured memory-pool differences (MB), one point per comparison, y = x and the target band."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 5))
    diffs = result["differences"]
    measured = [d["pool_mb"]["measured"] for d in diffs]
    predicted = [d["pool_mb"]["predicted"] for d in diffs]
    top = max(measured + predicted) * 1.15
    line = [min(0.0, *measured, *predicted), top]
    ax.plot(line, line, "k-", lw=1, label="predicted = measured")
    ax.fill_between(line, [v * (1 - result["target"]) for v in line], [v * (1 + result["target"]) for v in line],
                    color="tab:green", alpha=0.15, label=f"±{result['target']:.0%} (the bench's target)")
    ax.scatter(measured, predicted, zorder=3)
    for d, m, p in zip(diffs, measured, predicted):
        ax.annotate(d["comparison"], (m, p), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("measured difference of MindSpore's pool peak (MB)")
    ax.set_ylabel("planner's predicted difference (MB)")
    ax.legend(loc="upper left", fontsize=8)
    return ax
