"""The parallel layouts' runs (labkit.training.layouts), launched once per worker count and shared by the notebook
and the tests, and their comparison with the single-card reference.

    runs = parallel_runs()            # cached under runs/parallel_lab while newer than the code that made them
    table = compare(runs)             # per layout: loss and weight differences against their tolerance

The tolerance comes from float32 rounding, measured in the same launch: the reference runs in float32 and in
float64. A float32 run's rounding moves it from the exact result by about d = |float32 - float64| (the float64
run's own error is ~1e-9 smaller). A parallel float32 run sums in another order: its distance to the exact result
is of the same kind and size, so its distance to the float32 reference is at most ~2d; the tolerance is 4d (a
factor 2 for the maximum over elements of a second, independent rounding pattern), plus, for a loss, 2 float32
ulps (the loss is summed over workers in float32)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from labkit.errors import LabkitError
from labkit.launch.workers import run_workers
from labkit.model import scratch
from labkit.paths import ROOT, RUNS
from labkit.training import layouts

CACHE = RUNS / "parallel_lab"
SOURCES = ("labkit/model/scratch.py", "labkit/parallel/collectives.py", "labkit/training/sharded.py",
           "labkit/training/pipeline.py", "labkit/training/layouts.py", "labkit/data/loader.py")
MODES = ("auto", "run", "cached")


def _fresh(folder: Path) -> bool:
    done = folder / "DONE"
    return done.exists() and done.stat().st_mtime > max((ROOT / p).stat().st_mtime for p in SOURCES)


def parallel_runs(mode: str = "auto", root: Path = CACHE, timeout: float = 600) -> Path:
    """The folder with every layout's results: each worker count's launch, run now unless a fresh one is cached
    ("auto"), always ("run"), or never ("cached": an error when there is none)."""
    if mode not in MODES:
        raise LabkitError(f"mode '{mode}' is not known", f"use one of {', '.join(MODES)}")
    for workers in sorted(layouts.LAYOUTS):
        folder = root / f"workers{workers}"
        if mode == "auto" and _fresh(folder) or mode == "cached":
            if not _fresh(folder):
                raise LabkitError(f"no fresh results of the {workers}-worker layouts in {folder}",
                                  "run parallel_runs('run') (about a minute per worker count)")
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        expected = [lay.name for lay in layouts.LAYOUTS[workers]]
        run_workers([str(Path(layouts.__file__).resolve()), "worker", str(folder)], workers, folder,
                    what=f"the {workers}-worker parallel layouts", timeout=timeout,
                    expect=lambda: all(len(list((folder / n).glob("rank*.json"))) == workers for n in expected))
        (folder / "DONE").write_text("")
    return root


def load(root: Path, name: str) -> list[dict]:
    """Every rank's result of one layout (rank order), each with its final weights under "weights"."""
    found = sorted(root.glob(f"workers*/{name}/rank*.json"), key=lambda p: int(p.stem[4:]))
    if not found:
        raise LabkitError(f"no results of layout '{name}' under {root}", "run parallel_runs() first")
    rows = [json.loads(p.read_text()) for p in found]
    for row, p in zip(rows, found):
        with np.load(p.parent / f"weights_rank{row['rank']}.npz") as z:
            row["weights"] = dict(z)
    return rows


def gathered(rows: list[dict]) -> dict:
    """The full model from a layout's workers: tensor-parallel slices joined, pipeline stages merged (the first
    data-parallel replica; every replica holds the same weights)."""
    full, lay = {}, rows[0]["layout"]
    replica = [r for r in rows if r["place"][0] == 0]
    for name in {n for r in replica for n in r["weights"]}:
        parts = [r["weights"][name] for r in replica if name in r["weights"]]
        full[name] = scratch.unshard(name, parts) if lay["tp"] > 1 else parts[0]
    return full


def tolerances(root: Path) -> dict:
    f32, f64 = load(root, "single_float32")[0], load(root, "single_float64")[0]
    d_loss = max(abs(a - b) for a, b in zip(f32["losses"], f64["losses"]))
    d_w = max(float(np.abs(f32["weights"][k] - f64["weights"][k]).max()) for k in f32["weights"])
    ulp = float(np.spacing(np.float32(max(f32["losses"]))))
    return {"float32_vs_float64_loss": d_loss, "float32_vs_float64_weight": d_w,
            "loss": 4 * d_loss + 2 * ulp, "weight": 4 * d_w}


def compare(root: Path | None = None) -> dict:
    """Per layout: the largest loss and final-weight differences from the float32 single-card run, the tolerances,
    and what each worker held and sent."""
    root = root or parallel_runs("cached")
    tol = tolerances(root)
    ref = load(root, "single_float32")[0]
    out = {}
    for workers in sorted(layouts.LAYOUTS):
        for lay in layouts.LAYOUTS[workers]:
            rows = load(root, lay.name)
            full = gathered(rows)
            last = rows[-1]  # the last stage's (or any worker's) losses: every worker reports the global loss
            out[lay.name] = {
                "workers": workers,
                "loss_diff": max(abs(a - b) for a, b in zip(last["losses"], ref["losses"])),
                "weight_diff": max(float(np.abs(full[k] - ref["weights"][k]).max()) for k in ref["weights"]),
                "same_names": sorted(full) == sorted(ref["weights"]),
                "per_worker": [{k: r[k] for k in ("rank", "place", "held", "sent_bytes", "ideal_sent_bytes",
                                                  "io_bytes", "traffic", "pipeline", "seconds")} for r in rows]}
    return {"tolerance": tol, "reference": {k: ref[k] for k in ("losses", "grad_norms", "held")}, "layouts": out}
