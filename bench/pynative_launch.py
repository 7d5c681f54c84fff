"""MindSpore's operator launch on a CPU-only machine: asynchronous (its default) vs blocking (what labkit sets).

    python bench/pynative_launch.py                 # table
    python bench/pynative_launch.py --json          # one JSON object on stdout
    python bench/pynative_launch.py --repeats 3 --steps 10

Each measurement runs in a fresh process with MS_DEV_LAUNCH_BLOCKING=0 or =1 (MindSpore reads it once, at start),
interleaved (async, blocking, async, blocking, ...) so that machine drift falls on both. Two workloads:
- eager: PyNative forward + backward of the tiny model on one batch of 8 x 128 tokens, `--passes` times after one
  untimed pass (wall time and the process's CPU time over the timed passes);
- graph: `labkit train` of the tiny model for `--steps` steps in graph mode (the whole process: imports, compile,
  steps), the way every training run of the lab runs.
Both settings must give the same losses (the table shows them). Quote figures only from a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EAGER = """
import json, resource, sys, time
import numpy as np
import mindspore as ms
from labkit.config import model_preset
from labkit.logs import quiet_mindformers
from labkit.model.llama import build_model

quiet_mindformers()
ms.set_context(mode=ms.PYNATIVE_MODE)
model = build_model(model_preset("tiny"), seq_length=128, batch_size=8, seed=1)
model.set_train(True)
grad = ms.value_and_grad(model, None, model.trainable_params())
x = ms.Tensor(np.random.default_rng(0).integers(0, 4096, (8, 129)).astype(np.int32))
float(grad(x)[0])  # untimed: the first call builds what later calls reuse
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
t0, c0 = time.perf_counter(), cpu()
for _ in range(int(sys.argv[1])):
    loss = float(grad(x)[0])
print("RESULT " + json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "loss": loss}))
"""


def _env(blocking: bool) -> dict:
    return {**os.environ, "GLOG_v": "3", "MS_DEV_LAUNCH_BLOCKING": "1" if blocking else "0"}


def eager(blocking: bool, passes: int) -> dict:
    p = subprocess.run([sys.executable, "-c", EAGER, str(passes)], capture_output=True, text=True, cwd=ROOT,
                       env=_env(blocking), check=True)
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])


def graph(blocking: bool, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        before = os.times()
        subprocess.run([sys.executable, "-m", "labkit", "train", "--steps", str(steps), "--output", out, "--json",
                        "--set", "train.save_every=0", "--set", "train.peak_tflops=1"], capture_output=True,
                       cwd=ROOT, env=_env(blocking), check=True)
        after = os.times()
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": after.elapsed - before.elapsed,
            "cpu_s": after.children_user + after.children_system - before.children_user - before.children_system,
            "loss": rows[-1]["loss"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="processes per setting and workload")
    ap.add_argument("--passes", type=int, default=3, help="timed eager forward + backward passes per process")
    ap.add_argument("--steps", type=int, default=10, help="training steps of the graph-mode runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = {(w, b): [] for w in ("eager", "graph") for b in (False, True)}
    for _ in range(args.repeats):
        for b in (False, True):
            runs["eager", b].append(eager(b, args.passes))
        for b in (False, True):
            runs["graph", b].append(graph(b, args.steps))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")} | {"loss": v[0]["loss"]}
           for k, v in runs.items()}
    rows = []
    for w in ("eager", "graph"):
        a, b = med[w, False], med[w, True]
        rows.append({"workload": w, "async_wall_s": a["wall_s"], "blocking_wall_s": b["wall_s"],
                     "async_cpu_s": a["cpu_s"], "blocking_cpu_s": b["cpu_s"],
                     "wall_ratio": a["wall_s"] / b["wall_s"], "same_loss": a["loss"] == b["loss"],
                     "loss": b["loss"]})
    result = {"cpus": len(os.sched_getaffinity(0)), "repeats": args.repeats, "passes": args.passes,
              "steps": args.steps, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['cpus']} cores; median of {args.repeats} fresh processes per cell; eager = {args.passes} "
          f"forward + backward passes, graph = labkit train --steps {args.steps} (whole process)")
    print(f"{'workload':9} {'async s':>8} {'blocking s':>10} {'async CPU-s':>11} {'blocking CPU-s':>14} "
          f"{'async / blocking':>16} {'same loss':>9}")
    for r in rows:
        print(f"{r['workload']:9} {r['async_wall_s']:8.1f} {r['blocking_wall_s']:10.1f} {r['async_cpu_s']:11.1f} "
              f"{r['blocking_cpu_s']:14.1f} {r['wall_ratio']:16.2f} {str(r['same_loss']):>9}")
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
