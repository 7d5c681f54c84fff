"""Element-wise kernels, MindSpore against PyTorch on this CPU: the operator group where the training bench's account
(`python bench/train_throughput.py --profile`) finds most of MindSpore's gap.

Each case is a multiply the tiny Llama really runs, forward and backward, as a training step runs it: MindSpore
inside `@ms.jit` (value_and_grad), PyTorch eager with autograd; 16 of them chained in one pass (x = x * y), so a
graph launch is spread over many kernels as in a training step, and the figure is per multiply. Shapes are the tiny model's (micro-batch 8, seq 128,
8 heads of 32):
- same shape: a [8, 128, 256] activation times another (SiLU's gate, the residual branch);
- broadcast a weight: [8, 128, 256] times a [256] vector (RMSNorm's gain), whose backward sums over 1024 rows;
- broadcast a table: [8, 8, 128, 32] times a [128, 32] table (RoPE's cos and sin), summed over 64 (batch, head) pairs.
Each framework runs in its own fresh process with all cores; the figure is the best of several timed repeats of 20
passes (other processes only ever slow a run down). Quote figures only from a quiet machine, with the CPU.

    python bench/elementwise.py [--repeats 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = {"same shape": ((8, 128, 256), (8, 128, 256)), "broadcast a weight": ((8, 128, 256), (256,)),
         "broadcast a table": ((8, 8, 128, 32), (128, 32))}
CALLS = 20  # forward + backward passes per timed repeat
WARMUP = 10  # untimed passes first
CHAIN = 16  # multiplies per pass, chained (x = x * y) so that none can be merged and one launch is spread over many


def _product_sum(x, y):
    for _ in range(CHAIN):
        x = x * y
    return x.sum()


def mindspore_worker(repeats: int) -> dict:
    import numpy as np
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    out = {}
    for name, (sa, sb) in CASES.items():
        rng = np.random.default_rng(0)
        a, b = (ms.Tensor(rng.standard_normal(s).astype(np.float32)) for s in (sa, sb))
        grad = ms.value_and_grad(_product_sum, grad_position=(0, 1))

        @ms.jit
        def step(x, y):
            return grad(x, y)

        for _ in range(WARMUP):  # compile, then MindSpore tunes each kernel's thread split over its first calls
            step(a, b)[1][1].asnumpy()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(CALLS):
                r = step(a, b)
            r[1][1].asnumpy()
            best = min(best, time.perf_counter() - t)
        out[name] = best / CALLS / CHAIN
    return out


def torch_worker(repeats: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for name, (sa, sb) in CASES.items():
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(s, generator=g, requires_grad=True) for s in (sa, sb))

        def step():
            a.grad = b.grad = None
            _product_sum(a, b).backward()
            return b.grad

        for _ in range(WARMUP):
            step()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(CALLS):
                step()
            best = min(best, time.perf_counter() - t)
        out[name] = best / CALLS / CHAIN
    return out


def in_fresh_process(kind: str, repeats: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--worker", kind, str(repeats)], capture_output=True, text=True,
                       env={**os.environ, "GLOG_v": "3", "PYTHONPATH": str(ROOT)})
    if p.returncode:
        raise RuntimeError(f"{kind} worker failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from labkit.output import add_common_flags, emit
    from labkit.parallel.devices import cpu_matrix_isa

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        fn = mindspore_worker if argv[1] == "mindspore" else torch_worker
        print(json.dumps(fn(int(argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats of 20 passes; the best is kept")
    add_common_flags(ap)
    a = ap.parse_args(argv)
    load = os.getloadavg()[0]
    ms_t, pt_t = in_fresh_process("mindspore", a.repeats), in_fresh_process("torch", a.repeats)
    isa = cpu_matrix_isa()
    rows = [{"case": name, "shapes": [list(s) for s in CASES[name]], "mindspore_ms": ms_t[name] * 1e3,
             "torch_ms": pt_t[name] * 1e3, "ratio": ms_t[name] / pt_t[name]} for name in CASES]
    result = {"rows": rows, "machine": f"{isa['model']}, {os.cpu_count()} cores ({isa['summary']}); "
                                       f"load average {load:.1f} at start"}
    if a.json:
        emit(a, result)
        return 0
    print(f"{'one multiply, fwd + bwd':28} {'shapes':>28} {'MindSpore ms':>13} {'PyTorch ms':>11} {'MS / PT':>8}")
    for r in rows:
        shapes = " x ".join(str(tuple(s)) for s in r["shapes"])
        print(f"{r['case']:28} {shapes:>28} {r['mindspore_ms']:13.3f} {r['torch_ms']:11.3f} {r['ratio']:8.2f}")
    print(f"machine: {result['machine']}")
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
