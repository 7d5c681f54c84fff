"""Regenerate tests/golden/tiny_10min_val.json: the first points of configs/tiny_10min.yaml's validation curve.

    PYTHONPATH=. python tests/golden/make_tiny_10min_val.py

It trains the first STEPS steps of the config with an evaluation every EVERY steps (no samples: they do not change
the losses) in a fresh process and keeps the validation losses; tests/test_eval.py asserts the first two to 2e-4.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, EVERY = 8, 2
GOLDEN = Path(__file__).parent / "tiny_10min_val.json"
ARGS = ["train", "--config", "configs/tiny_10min.yaml", "--steps", str(STEPS), "--set", f"train.eval_every={EVERY}",
        "--set", "train.sample_prompts=[]", "--set", "train.peak_tflops=0.1", "--set", "train.save_every=0"]


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "labkit", *ARGS, "--output", out, "--json"], cwd=root, check=True,
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    from importlib.metadata import version

    val = [r for r in rows if "val_loss" in r]
    GOLDEN.write_text(json.dumps({
        "config": "configs/tiny_10min.yaml",
        "command": "labkit " + " ".join(ARGS) + " --output DIR",
        "regenerate": "PYTHONPATH=. python tests/golden/make_tiny_10min_val.py",
        "note": f"validation loss of the first steps (mindspore {version('mindspore')}, mindformers "
                f"{version('mindformers')}, x86_64 CPU); tests assert the first two to 2e-4",
        "steps": [r["step"] for r in val], "val_loss": [r["val_loss"] for r in val],
        "loss": [r["loss"] for r in rows]}, indent=1) + "\n", encoding="utf-8")
    print(GOLDEN.read_text())


if __name__ == "__main__":
    main()
