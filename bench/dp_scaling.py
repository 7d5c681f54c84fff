"""Data-parallel scaling on this machine: tokens/s of 1 worker x 2b against N workers x b (the same global batch),
and the share of a data-parallel step spent in the gradient all-reduce.

    python bench/dp_scaling.py                  # table
    python bench/dp_scaling.py --json           # one JSON object on stdout
    python bench/dp_scaling.py --steps 20 --workers 2

Throughput is the median over the steps after the first (which compiles the graph). The all-reduce is timed by
`labkit.launch.probe.measure_allreduce` on tensors shaped like the model's gradients (the reducer training uses).
On a shared machine the figures swing with the load: run it when the machine is quiet, and say so when quoting.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from labkit.output import add_common_flags, emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="data-parallel workers (compared with 1)")
    ap.add_argument("--micro-batch", type=int, default=4, help="b: samples per data-parallel worker per step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=20, help="timed all-reduce calls")
    ap.add_argument("--output", default="runs/bench/dp_scaling")
    add_common_flags(ap)
    args = ap.parse_args(argv)

    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        from labkit.launch import launcher as launch
        from labkit.launch import probe
        from labkit.paths import lab_path

        root = lab_path(args.output)
        n, b = args.workers, args.micro_batch
        sets = ["train.save_every=0", "train.keep_checkpoints=1", "train.global_batch=null"]
        runs = {}
        for w, mb in ((1, n * b), (n, b)):
            t = time.perf_counter()
            spec = launch.LaunchSpec("configs/tiny_cpu.yaml", w, sets, output=root / f"{w}w", micro_batch=mb,
                                     steps=args.steps, overwrite=True)
            res = launch.launch(spec, progress=not args.json)
            if not res.ok:
                print(res.report(), file=sys.stderr)
                return 1
            rows = [json.loads(x) for x in Path(res.metrics).read_text().splitlines()][1:]
            runs[w] = {"workers": w, "micro_batch": mb, "global_batch": n * b, "wall_s": time.perf_counter() - t,
                       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                       "step_s": statistics.median(r["step_time_s"] for r in rows),
                       "first_step_s": json.loads(Path(res.metrics).read_text().splitlines()[0])["step_time_s"]}
        probe = probe.measure_allreduce("tiny", workers=n, timings=probe.AllreduceTimings(repeats=args.repeats),
                                        output=root / "allreduce")
        g = probe["model_grads"]
        result = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}, "runs": list(runs.values()),
                  "speedup": runs[n]["tokens_per_s"] / runs[1]["tokens_per_s"], "backend": probe["backend"],
                  "allreduce_s": g["median_s"], "allreduce_mbytes": g["mbytes"],
                  "comm_share": g["median_s"] / runs[n]["step_s"], "sizes": probe["sizes"]}

    if args.json:
        emit(args, result)
        return 0
    print(f"{'workers':>7} {'micro_batch':>11} {'global':>6} {'tokens/s':>9} {'step s':>7} {'1st step s':>10}")
    for r in result["runs"]:
        print(f"{r['workers']:>7} {r['micro_batch']:>11} {r['global_batch']:>6} {r['tokens_per_s']:>9.0f} "
              f"{r['step_s']:>7.3f} {r['first_step_s']:>10.1f}")
    print(f"\n{n} workers / 1 worker throughput: {result['speedup']:.2f}x")
    print(f"gradient all-reduce ({result['backend']}, {g['mbytes']:.1f} MB): {g['median_s'] * 1e3:.0f} ms = "
          f"{result['comm_share']:.0%} of a {n}-worker step")
    print(f"\n{'all-reduce MB':>13} {'ms':>8} {'MB/s':>8}")
    for r in result["sizes"]:
        print(f"{r['mbytes']:>13.3f} {r['median_s'] * 1e3:>8.1f} {r['mbytes'] / r['median_s']:>8.0f}")
    print(f"\n{result['machine']['cpus']} CPUs, 1-minute load average {result['machine']['load_avg_1m']:.1f}")
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
