"""Rewrite tests/golden/tiny_cpu_losses.json: the first 8 losses of the tiny CPU run that tests/test_golden.py
checks. Run it only when a change is meant to alter the numbers, and say in that commit why (old vs new):

    python tests/golden/regen_losses.py
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

CONFIG = "configs/tiny_cpu.yaml"
STEPS = 8
SETS = ["train.micro_batch=8", "train.accum=1", "train.save_every=0", "train.peak_tflops=0.1"]


def run(output: str, *extra: str, log=None) -> tuple[list[float], dict]:
    """(losses, the run's summary); `extra` overrides go after SETS (none may change the losses)."""
    from labkit.config import load_run_config
    from labkit.training.metrics import read_metrics
    from labkit.training.trainer import train

    summary = train(load_run_config(CONFIG, [f"output_dir={output}", f"train.steps={STEPS}", *SETS, *extra]), log=log)
    return [r["loss"] for r in read_metrics(output)], summary


def main() -> None:
    import mindformers
    import mindspore

    with tempfile.TemporaryDirectory() as out:
        losses, _ = run(out)
    doc = {"config": CONFIG, "steps": STEPS, "overrides": SETS, "command": "python tests/golden/regen_losses.py",
           "versions": {"mindspore": mindspore.__version__, "mindformers": mindformers.__version__},
           "losses": losses}
    (HERE / "tiny_cpu_losses.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
