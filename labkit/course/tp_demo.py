"""What auto-parallel automates, done by hand: tensor parallelism over msrun workers with real collectives, and a
pipeline-schedule simulation.

Tensor parallel (Megatron-style, as mindformers' `model_parallel` shards a Llama layer):
  - MLP: w1 and w3 split by output rows (column parallel), w2 split by input columns (row parallel); each worker
    computes a partial output and one AllReduce(sum) completes it. A column-parallel layer followed by AllGather
    gives the full activation instead.
  - attention: the heads are split over workers (wq/wk/wv rows, wo columns); one AllReduce after wo.
The worker runs under `msrun --worker_num=2 --local_worker_num=2 --master_port=P --log_dir=D --join=True
labkit/course/tp_demo.py worker DIR [MLP.npz]` (CPU, mccl) and compares each block with the single-process result. With
MLP.npz (arrays x, w1, w3, w2, e.g. one layer of a real model: `save_mlp`) the MLP block uses those instead of random
weights, and each worker writes what it computed (`mlp_rank<i>.npz`: its partial sum and the all-reduced output),
so a notebook can compare the workers with its own split done in one process (`load_mlp_outputs`).

Pipeline: `pipeline_schedule` simulates GPipe and 1F1B timelines; the idle share is the bubble (p - 1) / m
(Narayanan et al. 2021, section 2.2); `plot_pipeline` draws them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SHAPES = dict(batch=2, seq=16, hidden=64, heads=4, ffn=176)  # heads and ffn divide by 2 workers


# ------------------------------------------------------------------------------------------ the worker


def _blocks(shapes: dict, seed: int = 0) -> dict:
    """The same input and weights on every worker (torch-like [out, in] layout)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b, s, h, f = shapes["batch"], shapes["seq"], shapes["hidden"], shapes["ffn"]
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    return {"x": rng.standard_normal((b, s, h)).astype(np.float32), "w1": w(f, h), "w3": w(f, h), "w2": w(h, f),
            "wq": w(h, h), "wk": w(h, h), "wv": w(h, h), "wo": w(h, h)}


def _mlp(x, w1, w3, w2, ops):
    """Llama's SwiGLU MLP: w2(silu(w1 x) * w3 x)."""
    return ops.matmul(ops.silu(ops.matmul(x, w1.T)) * ops.matmul(x, w3.T), w2.T)


def _attention(x, wq, wk, wv, wo, heads: int, ops):
    """Causal multi-head attention over the heads these weight rows hold."""
    import numpy as np
    import mindspore as ms

    b, s, _ = x.shape
    d = wq.shape[0] // heads
    split = lambda t: ops.transpose(ops.reshape(t, (b, s, heads, d)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = split(ops.matmul(x, wq.T)), split(ops.matmul(x, wk.T)), split(ops.matmul(x, wv.T))
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / float(np.sqrt(d))
    mask = ms.Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1))
    ctx = ops.matmul(ops.softmax(scores + mask, axis=-1), v)
    ctx = ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (b, s, heads * d))
    return ops.matmul(ctx, wo.T)


def save_mlp(path, x, w1, w3, w2) -> Path:
    """Write the MLP block's input and weights ([out, in] layout) for `run_tp_demo(mlp=path)`."""
    import numpy as np

    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in dict(x=x, w1=w1, w3=w3, w2=w2).items()}
    if arrays["w1"].shape != arrays["w3"].shape or arrays["w2"].shape[::-1] != arrays["w1"].shape:
        raise ValueError(f"w1 {arrays['w1'].shape}, w3 {arrays['w3'].shape} must be [ffn, hidden] and w2 [hidden, ffn]")
    np.savez(path, **arrays)
    return Path(path)


def load_mlp_outputs(out_dir) -> list[dict]:
    """Per rank, what the worker computed for the MLP: `partial` (its own sum, sent to the AllReduce) and `output`."""
    import numpy as np

    found = []
    for f in sorted(Path(out_dir).glob("mlp_rank*.npz"), key=lambda f: int(f.stem[len("mlp_rank"):])):
        with np.load(f) as z:
            found.append({k: z[k] for k in z.files})
    return found


def worker(out_dir: str, mlp_file: str | None = None) -> dict:
    """One msrun worker: split both blocks over the workers, combine with collectives, compare."""
    import numpy as np
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()  # mccl between CPU workers
    rank, n = get_rank(), get_group_size()
    sh = SHAPES
    if sh["ffn"] % n or sh["heads"] % n:
        raise ValueError(f"ffn {sh['ffn']} and heads {sh['heads']} must divide by {n} workers")
    blocks = _blocks(sh)
    blocks["x_mlp"] = blocks["x"]
    if mlp_file:  # the MLP block from a file (one layer of a real model), the same on every worker
        with np.load(mlp_file) as z:
            blocks.update(x_mlp=z["x"], w1=z["w1"], w3=z["w3"], w2=z["w2"])
    if blocks["w1"].shape[0] % n:
        raise ValueError(f"the MLP's {blocks['w1'].shape[0]} features must divide by {n} workers")
    t = {k: ms.Tensor(v) for k, v in blocks.items()}
    all_reduce, all_gather = ops.AllReduce(), ops.AllGather()

    # single-process reference: the whole weights on one worker
    ref_mlp = _mlp(t["x_mlp"], t["w1"], t["w3"], t["w2"], ops)
    ref_attn = _attention(t["x"], t["wq"], t["wk"], t["wv"], t["wo"], sh["heads"], ops)

    fs = blocks["w1"].shape[0] // n
    rows = slice(rank * fs, (rank + 1) * fs)
    w1, w3 = t["w1"][rows], t["w3"][rows]  # column parallel: this worker's output features
    w2 = t["w2"][:, rows]  # row parallel: the matching input features
    partial = _mlp(t["x_mlp"], w1, w3, w2, ops)  # this worker's share of the sum
    tp_mlp = all_reduce(partial)  # partial sums -> full output
    np.savez(Path(out_dir, f"mlp_rank{rank}.npz"), partial=partial.asnumpy(), output=tp_mlp.asnumpy())

    gate_local = ops.matmul(t["x_mlp"], w1.T)  # column-parallel layer, then AllGather the features
    gathered = all_gather(ops.transpose(gate_local, (2, 0, 1)))  # gathers along axis 0: features first
    tp_gate = ops.transpose(gathered, (1, 2, 0))
    ref_gate = ops.matmul(t["x_mlp"], t["w1"].T)

    hs = sh["heads"] // n
    dh = sh["hidden"] // sh["heads"]
    cols = slice(rank * hs * dh, (rank + 1) * hs * dh)
    tp_attn = all_reduce(_attention(t["x"], t["wq"][cols], t["wk"][cols], t["wv"][cols], t["wo"][:, cols], hs, ops))

    diff = lambda a, b: float(np.max(np.abs(a.asnumpy() - b.asnumpy())))  # noqa: E731
    act_bytes = int(np.prod(ref_mlp.shape)) * 4
    result = {
        "rank": rank, "workers": n, "shapes": sh,
        "max_abs_diff": {"mlp": diff(tp_mlp, ref_mlp), "attention": diff(tp_attn, ref_attn),
                         "column_allgather": diff(tp_gate, ref_gate)},
        "max_abs_value": {"mlp": float(np.max(np.abs(ref_mlp.asnumpy()))),
                          "attention": float(np.max(np.abs(ref_attn.asnumpy())))},
        "local_weights": {"w1": list(w1.shape), "w2": list(w2.shape), "wq": list(t["wq"][cols].shape),
                          "wo": list(t["wo"][:, cols].shape)},
        "allreduce_bytes_per_block": act_bytes,
    }
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------- the launcher


def run_tp_demo(workers: int = 2, *, output_dir: str | os.PathLike | None = None, timeout: float = 300,
                mlp: str | os.PathLike | None = None) -> dict:
    """Start the worker under msrun on CPU and return the max abs difference per block (worst over workers).
    `mlp`: an .npz from `save_mlp` for the MLP block (default: random weights of SHAPES).

    msrun puts each worker in its own session, so on a timeout or a failed worker the launcher's supervisor ends
    msrun's process group and every worker's session: nothing is left running."""
    from labkit.errors import LabkitError
    from labkit.launch.workers import run_workers
    from labkit.paths import RUNS

    if workers < 2:
        raise LabkitError(f"the tensor-parallel demo needs >= 2 workers, got {workers}")
    out = Path(output_dir) if output_dir else RUNS / "tp_demo" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank_*.json"), *out.glob("mlp_rank*.npz")]:
        old.unlink()
    task = ["python", "-m", "labkit.course.tp_demo", "worker", str(out)] + ([str(Path(mlp).resolve())] if mlp else [])
    run = run_workers(task, workers, out, what="the tensor-parallel demo", timeout=timeout,
                      expect=lambda: len(list(out.glob("rank_*.json"))) == workers)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    worst = {k: max(r["max_abs_diff"][k] for r in results) for k in results[0]["max_abs_diff"]}
    return {"workers": workers, "max_abs_diff": worst, "per_rank": results, "seconds": run.seconds,
            "command": run.command, "log_dir": str(run.log_dir), "pids": run.pids}


# ----------------------------------------------------------------------------------- pipeline schedules


def pipeline_schedule(stages: int, micro_batches: int, schedule: str = "1f1b", t_forward: float = 1.0,
                      t_backward: float = 2.0) -> list[dict]:
    """Simulate a pipeline step: each stage runs its forward (F) and backward (B) passes in the schedule's order,
    as soon as the previous stage's forward (or the next stage's backward) of that micro-batch is done.

    gpipe: all forwards, then all backwards. 1f1b (PipeDream-Flush): stage i runs p - i - 1 warm-up forwards, then
    alternates one forward and one backward. Returns events {stage, kind, micro, start, end}."""
    p, m = stages, micro_batches
    if p < 1 or m < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    orders = []
    for i in range(p):
        if schedule == "gpipe":
            order = [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
        elif schedule == "1f1b":
            warm = min(p - i - 1, m)
            order = [("F", k) for k in range(warm)]
            for k in range(m - warm):
                order += [("F", warm + k), ("B", k)]
            order += [("B", k) for k in range(m - warm, m)]
        else:
            raise ValueError(f"schedule '{schedule}' is not known: use gpipe or 1f1b")
        orders.append(order)
    done: dict[tuple, float] = {}
    free = [0.0] * p
    pos = [0] * p
    events = []
    while any(pos[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            if pos[i] >= len(orders[i]):
                continue
            kind, k = orders[i][pos[i]]
            dep = ("F", i - 1, k) if kind == "F" and i > 0 else ("B", i + 1, k) if kind == "B" and i < p - 1 \
                else ("F", i, k) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[i], done.get(dep, 0.0))
            end = start + (t_forward if kind == "F" else t_backward)
            done[(kind, i, k)] = end
            free[i] = end
            pos[i] += 1
            events.append({"stage": i, "kind": kind, "micro": k, "start": start, "end": end})
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # cannot happen for gpipe / 1f1b
    return events


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle time relative to the ideal compute time: (p - 1) / m (GPipe and 1F1B alike)."""
    return (stages - 1) / micro_batches


def simulated_bubble(events: list[dict]) -> float:
    """Idle time over busy time per stage, from a simulated schedule (equals (p - 1) / m)."""
    stages = max(e["stage"] for e in events) + 1
    makespan = max(e["end"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events) / stages
    return (makespan - busy) / busy


def peak_in_flight(events: list[dict], stage: int = 0) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not yet)."""
    marks = sorted([(e["end"], 1) for e in events if e["stage"] == stage and e["kind"] == "F"]
                   + [(e["end"], -1) for e in events if e["stage"] == stage and e["kind"] == "B"],
                   key=lambda x: (x[0], x[1]))
    live = peak = 0
    for _, d in marks:
        live += d
        peak = max(peak, live)
    return peak


def plot_pipeline(events: list[dict], ax=None, title: str | None = None):
    """Gantt chart of a schedule: one row per stage, forwards blue, backwards orange, micro-batch numbers."""
    import matplotlib.pyplot as plt

    stages = max(e["stage"] for e in events) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 * stages + 1))
    for e in events:
        ax.broken_barh([(e["start"], e["end"] - e["start"])], (stages - 1 - e["stage"] - 0.4, 0.8),
                       facecolors="tab:blue" if e["kind"] == "F" else "tab:orange", edgecolors="white")
        ax.text((e["start"] + e["end"]) / 2, stages - 1 - e["stage"], str(e["micro"]), ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {stages - 1 - i}" for i in range(stages)])
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(title or f"bubble {simulated_bubble(events):.0%} of compute")
    return ax


def _main(argv: list[str]) -> int:
    import argparse

    # positional arguments only: msrun's own parser would take any option that abbreviates one of its own
    ap = argparse.ArgumentParser(description="tensor-parallel demo worker (run under msrun); from Python call "
                                 "labkit.course.tp_demo.run_tp_demo()")
    ap.add_argument("role", choices=["worker"], help="run as one msrun worker")
    ap.add_argument("out", help="directory for rank_<i>.json")
    ap.add_argument("mlp", nargs="?", help="optional .npz with the MLP block's x, w1, w3, w2 (save_mlp)")
    args = ap.parse_args(argv)
    worker(args.out, args.mlp)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
