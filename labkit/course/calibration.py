"""Notebook 06c's calibration of the planner: bench/plan_calibration.py's result (about 2 minutes to measure), reused
while it is newer than the bench and every module whose predictions it checks.

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

BENCH = ROOT / "bench" / "plan_calibration.py"
CACHE = RUNS / "bench" / "plan_calibration.json"  # what `bench/plan_calibration.py --ci` writes
MODES = ("auto", "run", "cached", "skip")
# the modules whose figures the calibration measures: the planner's memory and time models, and the model they count
DEPENDS_ON = ("labkit/parallel/memory.py", "labkit/parallel/planner.py", "labkit/parallel/devices.py",
              "labkit/model/shapes.py", "labkit/model/llama.py", "labkit/config.py")


def sources() -> list[Path]:
    """The bench script and the modules it checks (each must exist: a moved module would otherwise go unnoticed)."""
    paths = [BENCH, *(ROOT / p for p in DEPENDS_ON)]
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    if missing:
        raise LabkitError(f"the calibration depends on files that do not exist: {', '.join(missing)}",
                          "update labkit/course/calibration.py's DEPENDS_ON to the modules' new paths")
    return paths


def is_fresh(cache: Path = CACHE, deps: list[Path] | None = None) -> bool:
    """True when `cache` exists and is newer than every file in `deps` (default: `sources()`)."""
    deps = sources() if deps is None else deps
    return cache.exists() and cache.stat().st_mtime > max(p.stat().st_mtime for p in deps)


def bench_module():
    """bench/plan_calibration.py as a module (it is a script, not part of the package): TARGET, table(), ..."""
    spec = importlib.util.spec_from_file_location("plan_calibration", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(cwd: Path | None = None, timeout: float = 1200) -> dict:
    """Run `bench/plan_calibration.py --ci --json` now (about 2 minutes on 2 cores); it also refreshes CACHE."""
    proc = subprocess.run([sys.executable, str(BENCH), "--ci", "--json"], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT)
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        result = {"ok": False, "error": f"no JSON on stdout (exit {proc.returncode})"}
    if not result.get("ok"):
        raise LabkitFailure(f"the calibration failed: {result.get('error')}",
                            f"run `python {BENCH.relative_to(ROOT)} --ci` to see it; last lines:\n{proc.stderr[-1500:]}")
    return result


def calibration(mode: str = "auto", *, cache: Path = CACHE, cwd: Path | None = None) -> tuple[dict | None, str]:
    """The calibration result and a line saying where it came from.

    auto: the cache when it is fresh (`is_fresh`), else measured now; run: always measured; cached: the cache
    whatever its age (None without one); skip: None."""
    if mode not in MODES:
        raise LabkitError(f"calibration mode '{mode}' is not known", f"use one of {', '.join(MODES)}")
    if mode == "skip":
        return None, "calibration skipped (calibration = \"skip\"): nothing measured, nothing compared"
    if mode == "run" or (mode == "auto" and not is_fresh(cache)):
        t0 = time.time()
        return measure(cwd), f"measured now ({time.time() - t0:.0f} s; the cache was missing or older than its sources)"
    if not cache.exists():
        return None, f"no cached calibration at {cache}"
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(cache.stat().st_mtime))
    return json.loads(cache.read_text(encoding="utf-8")), f"cached {cache.name} ({stamp}, newer than its sources)"


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
