"""Two runs side by side: losses step by step and the final weights, the evidence that data parallel equals one card."""
from __future__ import annotations

from pathlib import Path

from labkit.errors import LabkitError
from labkit.training import checkpoint
from labkit.training.metrics import read_metrics
from labkit.training.metrics import steady_throughput as metrics_steady_throughput


def _run_and_checkpoint(path) -> tuple[Path, Path | None]:
    """(run folder, checkpoint): a run folder gives its newest checkpoint; a checkpoint folder gives itself."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path.parent.parent, path
    return path, checkpoint.latest(path)


def compare_runs(run_a, run_b) -> dict:
    """Losses (metrics.jsonl) and model weights (optimizer state excluded) of two runs: run folders (their newest
    checkpoints) or checkpoint folders (<run>/checkpoints/step_N)."""
    import numpy as np


    (run_a, ca), (run_b, cb) = _run_and_checkpoint(run_a), _run_and_checkpoint(run_b)
    ma, mb = (read_metrics(r) for r in (run_a, run_b))
    if not ma or not mb:
        raise LabkitError(f"no metrics.jsonl in {run_a if not ma else run_b}", "compare two finished runs")
    la = {r["step"]: r["loss"] for r in ma}
    lb = {r["step"]: r["loss"] for r in mb}
    steps = sorted(set(la) & set(lb))
    if ca is None or cb is None:
        raise LabkitError(f"no complete checkpoint in {run_a if ca is None else run_b}")
    wa, wb = checkpoint.load_weights(ca), checkpoint.load_weights(cb)
    if set(wa) != set(wb):
        raise LabkitError(f"the checkpoints hold different parameters: {sorted(set(wa) ^ set(wb))[:3]}")
    worst, max_diff, max_abs = None, 0.0, 0.0
    for name in wa:
        x, y = wa[name].asnumpy().astype(np.float64), wb[name].asnumpy().astype(np.float64)
        d = float(np.abs(x - y).max()) if x.size else 0.0
        max_abs = max(max_abs, float(np.abs(x).max()) if x.size else 0.0)
        if d >= max_diff:
            worst, max_diff = name, d
    return {"steps": steps, "loss_a": [la[s] for s in steps], "loss_b": [lb[s] for s in steps],
            "max_loss_diff": max((abs(la[s] - lb[s]) for s in steps), default=None),
            "checkpoint_a": str(ca), "checkpoint_b": str(cb), "parameters": len(wa),
            "max_weight_diff": max_diff, "worst_parameter": worst, "max_abs_weight": max_abs,
            "identical": max_diff == 0.0}


def steady_throughput(run) -> float | None:
    """tokens/s of a run's median steady step (labkit.training.metrics.steady_throughput: the one definition)."""
    return metrics_steady_throughput(read_metrics(run))["tokens_per_s"]
