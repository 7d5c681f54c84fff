"""Learning-rate, warmup and init sweeps of the tiny model: where does training stop being stable?

    python bench/lr_sweep.py                          # lr 3e-4 upward (x10 per run) until one diverges
    python bench/lr_sweep.py --lrs 3e-4 1e-3 3e-3 1e-2 --steps 60 --warmup 0 6
    python bench/lr_sweep.py --init-std 0.02 0.2 --lrs 3e-3
    python bench/lr_sweep.py --json                   # one JSON object on stdout

Every run is labkit's real Trainer (clipping at train.grad_clip, as configured) on the tiny config, in this one
process (one MindSpore import; each run compiles its own graph). A run "diverged" when the trainer stopped on a
non-finite loss or gradient (LabkitFailure naming the step) or when its final loss ended above its first one.
The sweep over lr stops after the first diverged run unless --all. Notebook 08a runs two or three of these points;
this script is for the full picture. Quote figures only from a quiet machine, with its CPU (`lscpu`).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_run(config: str, out: Path, steps: int, lr: float, warmup: int, init_std: float | None) -> dict:
    from labkit.config import load_run_config
    from labkit.errors import LabkitFailure
    from labkit.training.metrics import read_metrics
    from labkit.training.trainer import train

    sets = [f"output_dir={out}", f"train.steps={steps}", f"train.lr={lr}", f"train.min_lr={lr / 10}",
            f"train.warmup_steps={warmup}", "train.save_every=0", "train.peak_tflops=1"]
    if init_std is not None:
        sets.append(f"model.init_std={init_std}")
    alerts = []
    nan_step = None
    try:
        train(load_run_config(config, sets), log=alerts.append)
    except LabkitFailure as e:
        m = re.match(r"step (\d+):", str(e))
        nan_step = int(m.group(1)) if m else -1
    h = read_metrics(out)
    diverged = nan_step is not None or (len(h) > 1 and h[-1]["loss"] > h[0]["loss"])
    return {"lr": lr, "warmup_steps": warmup, "init_std": init_std, "steps_run": len(h),
            "first_loss": h[0]["loss"] if h else None, "final_loss": h[-1]["loss"] if h else None,
            "grad_norm_max": max((r["grad_norm"] for r in h), default=None),
            "grad_norm_alerts": sum("above alert threshold" in a for a in alerts), "nan_step": nan_step,
            "diverged": diverged}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4 * 10 ** k for k in range(7)])
    p.add_argument("--warmup", type=int, nargs="+", default=[0])
    p.add_argument("--init-std", type=float, nargs="+", default=[None])
    p.add_argument("--all", action="store_true", help="run every lr even after one diverged")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for std in a.init_std:
            for warmup in a.warmup:
                for lr in a.lrs:
                    out = Path(tmp) / f"lr{lr:g}_w{warmup}_s{std}"
                    rows.append(one_run(a.config, out, a.steps, lr, warmup, std))
                    print(json.dumps(rows[-1]), file=sys.stderr)
                    if rows[-1]["diverged"] and not a.all:
                        break
    if a.json:
        print(json.dumps({"config": a.config, "steps": a.steps, "runs": rows}))
    else:
        cols = ("lr", "warmup_steps", "init_std", "first_loss", "final_loss", "grad_norm_max", "grad_norm_alerts",
                "nan_step", "diverged")
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
