"""Graph compile time of the training step: per-gradient operations as Python loops vs through `ops.HyperMap`.

    python bench/compile_time.py                # table
    python bench/compile_time.py --json         # one JSON object on stdout
    python bench/compile_time.py --accum 1 4 --steps 6

The step graph unscales, checks, measures, clips and (with accumulation) adds every gradient. Written as Python
comprehensions over the gradient tuple, MindSpore unrolls each operation into one node per tensor; `labkit.training.trainer`
applies them with `HyperMap` over `MultitypeFuncGraph`s instead. Each variant trains the tiny model for a few
steps with labkit's real Trainer in a fresh process (no compile cache carries over), both on the native path
(`train.kernels=native`: `nn.AdamWeightDecay` takes the gradient tuple the loops build); the first step's time is
compile + one step, the steady step time is the median of the others. Both variants give the same losses, which
the table shows. Quote figures only from a quiet machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _compile_loops(self, net):
    """The step as it was first written: one Python loop per per-gradient operation (for comparison only)."""
    import mindspore as ms
    from mindspore import ops

    opt, clip, accum = self.opt, self.cfg.train.grad_clip, self.cfg.train.accum
    acc, grad_fn = self._accumulators(), self._grad_fn(net)  # the same buffers and gradients as labkit's step

    @ms.jit
    def accumulate(x, scale):
        (_, loss), grads = grad_fn(x, scale)
        for a, g in zip(acc, grads):
            ops.assign_add(a, g.astype(ms.float32))
        return loss

    @ms.jit
    def step(x, scale, denom):
        (_, loss), grads = grad_fn(x, scale)
        if accum > 1:
            grads = tuple(a + g.astype(ms.float32) for a, g in zip(acc, grads))
        grads = tuple(g.astype(ms.float32) / denom for g in grads)
        norm = ops.sqrt(ops.addn([ops.reduce_sum(ops.square(g)) for g in grads]))
        finite = ops.isfinite(norm)  # as labkit's tail on O0 without loss scaling (tiny_cpu.yaml)
        if clip > 0:
            factor = ops.minimum(clip / (norm + 1e-6), 1.0)
            grads = tuple(g * factor for g in grads)
        opt(grads)
        if accum > 1:
            for a in acc:
                ops.assign(a, ops.zeros_like(a))
        return loss, finite, norm

    self._accumulate, self._step = accumulate, step


def worker(variant: str, accum: int, steps: int, output: str) -> dict:
    from labkit.training import trainer as T
    from labkit.config import load_run_config

    if variant == "loops":
        T.Trainer._compile = _compile_loops
    cfg = load_run_config("configs/tiny_cpu.yaml", [
        f"output_dir={output}", f"train.steps={steps}", f"train.micro_batch={8 // accum}", f"train.accum={accum}",
        "train.save_every=0", "train.keep_checkpoints=1", "train.peak_tflops=1", "train.kernels=native"])
    start = time.perf_counter()
    trainer = T.Trainer(cfg)
    setup_s = time.perf_counter() - start
    trainer.run()
    h = trainer.history
    return {"variant": variant, "accum": accum, "setup_s": setup_s, "first_step_s": h[0]["step_time_s"],
            "step_s": statistics.median(r["step_time_s"] for r in h[1:]), "losses": [r["loss"] for r in h]}


def main(argv=None) -> int:
    from labkit.output import add_common_flags, emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4], help="accumulation counts (global batch 8)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--output", default="runs/bench/compile_time")
    add_common_flags(ap)
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "ACCUM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        with contextlib.redirect_stdout(sys.stderr):
            row = worker(args.worker[0], int(args.worker[1]), args.steps, args.output)
        print(json.dumps(row))
        return 0

    from labkit.paths import lab_path

    root, rows = lab_path(args.output), []
    for accum in args.accum:
        for variant in ("loops", "hypermap"):
            out = root / f"{variant}_accum{accum}"
            p = subprocess.run([sys.executable, __file__, "--worker", variant, str(accum), "--steps", str(args.steps),
                                "--output", str(out)], capture_output=True, text=True, cwd=lab_path("."))
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    for accum in args.accum:
        a, b = (next(r for r in rows if r["accum"] == accum and r["variant"] == v) for v in ("loops", "hypermap"))
        b["compile_ratio"] = a["first_step_s"] / b["first_step_s"]
        b["max_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    result = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}, "rows": rows}
    if args.json:
        emit(args, result)
        return 0
    print(f"{'variant':10} {'accum':>5} {'first step (s)':>15} {'steady step (s)':>16} {'loops/hypermap':>15} "
          f"{'max |loss diff|':>16}")
    for r in rows:
        ratio = f"{r['compile_ratio']:.2f}x" if "compile_ratio" in r else ""
        diff = f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else ""
        print(f"{r['variant']:10} {r['accum']:>5} {r['first_step_s']:>15.1f} {r['step_s']:>16.3f} {ratio:>15} "
              f"{diff:>16}")
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end; first step = graph compile + one step")
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    raise SystemExit(main())
