"""Every parallel layout of the course, trained for a few steps in one msrun launch per worker count, and the
single-card reference they must equal.

    msrun --worker_num=2 ... python -m labkit.training.layouts worker OUT   (every layout of 2 workers in turn,
                                                       then the references: float32 on rank 0, float64 on 1)
    python -m labkit.training.layouts reference OUT --dtype float64       (a reference alone)
    msrun --worker_num=2 ... python -m labkit.training.layouts memory OUT --only sp2   (one step at seq 256, a
                                                       launch per layout: a process's pool peak is its layout's)

Started as a module, never as a script: a script's folder goes first on the import path, and this folder's
profile.py would hide the standard library's (which transformers imports).

A launch pays MindSpore's start-up once and runs its layouts one after the other; each writes, per rank,
OUT/<layout>/rank<r>.json (losses, grad norms, bytes held and sent, the pipeline's timeline) and
OUT/<layout>/weights_rank<r>.npz (the worker's final parameters, its tensor-parallel slices as they are; an
optimizer-parallel worker gathers its full weights from the slices to save them).
The reference runs the same model, data, seed and step on one process, in float32 (the run to equal) and in
float64 (to measure how far float32 rounding alone moves the float32 run: the tolerance's yardstick)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from labkit.config import model_preset
from labkit.data.dataset import ensure_dataset
from labkit.data.loader import make_loader
from labkit.io import atomic_write_text
from labkit.model import scratch
from labkit.parallel.collectives import Group, Traffic, io_bytes, make_group
from labkit.runtime import prepare_process
from labkit.training.optimizer_parallel import OptimizerParallel
from labkit.training.pipeline import pipeline_step
from labkit.training.sharded import HandLayout, Optim, Worker

LAYOUTS = {
    2: [HandLayout("dp2", dp=2), HandLayout("tp2", tp=2), HandLayout("sp2", tp=2, sp=True),
        HandLayout("pp2_gpipe", pp=2, micro=4, schedule="gpipe"),
        HandLayout("pp2_1f1b", pp=2, micro=4, schedule="1f1b"),
        HandLayout("zero1", dp=2, zero=1, micro=2), HandLayout("zero2", dp=2, zero=2, micro=2),
        HandLayout("opt1", dp=2, opt_level=1, micro=2), HandLayout("opt2", dp=2, opt_level=2, micro=2),
        HandLayout("opt3", dp=2, opt_level=3, micro=2)],
    4: [HandLayout("dp2_tp2", dp=2, tp=2)],
}
SETTINGS = dict(preset="tiny", seq_len=32, global_batch=8, steps=3, seed=1234)
REFERENCE = HandLayout("single")
# The activation-memory probe: MindSpore prints its memory pool's peak when a process ends, so each layout measured
# has a launch of its own (the CPU backend gathers only on the world group), one step at a sequence long
# enough for the norm tensors sequence parallelism splits (8 x 256 x 256 floats = 2 MiB each) to stand out of the
# pool's 1 MiB print resolution. tp2_whole_vocab is tp2 with the embedding and the head kept whole on each worker:
# what the vocabulary-parallel head and loss save.
MEMORY_LAYOUTS = [HandLayout("single"), HandLayout("tp2", tp=2), HandLayout("sp2", tp=2, sp=True),
                  HandLayout("tp2_whole_vocab", tp=2, vocab=False)]
MEMORY_SETTINGS = dict(SETTINGS, seq_len=256, steps=1)


def model_cfg(settings: dict = SETTINGS):
    return model_preset(settings["preset"])


def step_batches(layout: HandLayout, dp_index: int, settings: dict = SETTINGS):
    """Per optimizer step, the list of micro-batches (token ids [b, s+1]) this data-parallel index reads."""
    dataset = ensure_dataset(settings["seq_len"], progress=False)
    mb = settings["global_batch"] // (layout.dp * layout.micro)
    it = make_loader(dataset, mb, seed=settings["seed"], dp_size=layout.dp, dp_rank=dp_index, accum=layout.micro)
    while True:
        yield [next(it) for _ in range(layout.micro)]


def groups_of(layout: HandLayout, rank: int, world: int, traffic: Traffic) -> dict:
    d, s, t = layout.place(rank)
    tp, pp = layout.tp, layout.pp
    members = {"tp": [(d * pp + s) * tp + i for i in range(tp)],
               "dp": [(i * pp + s) * tp + t for i in range(layout.dp)],
               "pp": [(d * pp + i) * tp + t for i in range(pp)]}
    if world == 1:
        return {k: Group("none", 1, 0, (0,), traffic) for k in members}
    return {k: make_group(v, rank, world, traffic) for k, v in members.items()}


def train_layout(layout: HandLayout, rank: int, world: int, out: Path, settings: dict = SETTINGS,
                 dtype=np.float32) -> dict:
    cfg = model_cfg(settings)
    layout.check(cfg, settings["global_batch"])
    traffic = Traffic()
    groups = groups_of(layout, rank, world, traffic)
    kind = OptimizerParallel if layout.opt_level else Worker
    worker = kind(cfg, layout, scratch.init(cfg, settings["seed"]), rank, groups, Optim(), dtype)
    batches = step_batches(layout, layout.place(rank)[0], settings)
    steps, t0 = [], time.time()
    io0 = io_bytes()
    for _ in range(settings["steps"]):
        micro = next(batches)
        row = pipeline_step(worker, micro) if layout.pp > 1 else worker.train_step(micro)
        steps.append(row)
    io = io_bytes() - io0
    result = {"layout": asdict(layout), "rank": rank, "place": layout.place(rank), "dtype": np.dtype(dtype).name,
              "losses": [r["loss"] for r in steps], "grad_norms": [r["grad_norm"] for r in steps],
              "held": worker.bytes_held(), "traffic": traffic.as_dict(), "sent_bytes": traffic.total(),
              "ideal_sent_bytes": traffic.total(ideal=True), "io_bytes": io, "seconds": time.time() - t0,
              "pipeline": [{k: r[k] for k in ("peak_held_microbatches", "idle_share", "timeline")}
                           for r in steps if "timeline" in r]}
    where = out / layout.name
    where.mkdir(parents=True, exist_ok=True)
    np.savez(where / f".weights_rank{rank}.tmp.npz", **worker.weights())
    os.replace(where / f".weights_rank{rank}.tmp.npz", where / f"weights_rank{rank}.npz")
    atomic_write_text(where / f"rank{rank}.json", json.dumps(result))
    return result


def _context():
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.training.layouts")
    ap.add_argument("what", choices=("worker", "reference", "memory"))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all of the worker count)")
    args = ap.parse_args(argv)
    prepare_process("CPU")  # the by-hand parallel layouts run on CPU workers
    _context()
    out = Path(args.out)
    if args.what == "reference":
        ref = HandLayout(f"single_{args.dtype}")
        train_layout(ref, 0, 1, out, dtype=np.dtype(args.dtype).type)
        return 0
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    if args.what == "memory":  # one layout of MEMORY_LAYOUTS (--only); MindSpore prints the pool's peak at exit
        train_layout({lay.name: lay for lay in MEMORY_LAYOUTS}[args.only], rank, world, out, MEMORY_SETTINGS)
        return 0
    wanted = [s for s in args.only.split(",") if s]
    for layout in LAYOUTS[world]:
        if not wanted or layout.name in wanted:
            train_layout(layout, rank, world, out)
    if world == 2 and not wanted:  # start-up is paid: the two references run here, one per worker, side by side
        dtype = ("float32", "float64")[rank]
        train_layout(HandLayout(f"single_{dtype}"), 0, 1, out, dtype=np.dtype(dtype).type)  # a world of one
    return 0


if __name__ == "__main__":
    sys.exit(main())
