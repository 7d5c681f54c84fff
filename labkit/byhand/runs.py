"""Every parallel layout of the course, trained for a few steps in one msrun launch per worker count, and the
single-card reference they must equal.

    msrun --worker_num=2 ... python -m labkit.byhand.runs worker OUT      (every layout of 2 workers in turn,
                                                       then the references: float32 on rank 0, float64 on 1)
    python -m labkit.byhand.runs reference OUT --dtype float64          (a reference alone)
    msrun --worker_num=2 ... python -m labkit.byhand.runs memory OUT --only sp2      (one step at seq 256, a
                                                       launch per layout: a process's pool peak is its layout's)

Started as a module, never as a script: a script's folder goes first on the import path, and this folder's
profile.py would hide the standard library's (which transformers imports).

A launch pays MindSpore's start-up once and runs its layouts one after the other; each writes, per rank,
OUT/<layout>/rank<r>.json (a `RankResult`: losses, grad norms, bytes held and sent, the pipeline's timeline) and
OUT/<layout>/weights_rank<r>.npz (the worker's final parameters, its tensor-parallel slices as they are; an
optimizer-parallel worker gathers its full weights from the slices to save them) and its shard of a checkpoint of
the final step, OUT/<layout>/ckpt/step_<n>/ (labkit.byhand.shards); the sources of the resumes also save one at
step RESUME_AT. After its layouts a launch resumes runs under another layout (`RESUMES`): each merges a source's
checkpoint of step RESUME_AT (written earlier in the same launch: a barrier on every worker first), cuts it for the
target's ranks, and trains the remaining steps; its result is OUT/resume_<source>_to_<target>/ like a layout's.
The reference runs the same model, data, seed and step on one process, in float32 (the run to equal) and in
float64 (to measure how far float32 rounding alone moves the float32 run: the tolerance's yardstick)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from labkit.byhand import reshard, shards
from labkit.byhand.comm import Group, Op, Sent, Traffic, io_bytes, make_group, op_named
from labkit.byhand.context_parallel import ContextParallel, RingStep
from labkit.byhand.optimizer_parallel import OptimizerParallel
from labkit.byhand.pipeline_parallel import StageStep, pipeline_step
from labkit.byhand.worker import HandLayout, Held, Place, Worker
from labkit.config import TrainConfig, model_preset
from labkit.data.dataset import ensure_dataset
from labkit.data.loader import make_loader
from labkit.errors import LabkitError
from labkit.io import atomic_write_text
from labkit.model import scratch
from labkit.runtime import prepare_process

LAYOUTS = {
    2: [HandLayout("dp2", dp=2), HandLayout("tp2", tp=2), HandLayout("sp2", tp=2, sp=True),
        HandLayout("pp2_gpipe", pp=2, micro=4, schedule="gpipe"),
        HandLayout("pp2_1f1b", pp=2, micro=4, schedule="1f1b"),
        HandLayout("zero1", dp=2, zero=1, micro=2), HandLayout("zero2", dp=2, zero=2, micro=2),
        HandLayout("opt1", dp=2, opt_level=1, micro=2), HandLayout("opt2", dp=2, opt_level=2, micro=2),
        HandLayout("opt3", dp=2, opt_level=3, micro=2),
        HandLayout("cp2_ring", cp=2), HandLayout("cp2_ulysses", cp=2, cp_algo="ulysses")],
    4: [HandLayout("dp2_tp2", dp=2, tp=2), HandLayout("dp2_pp2", dp=2, pp=2, micro=2),
        HandLayout("sp2_pp2", tp=2, sp=True, pp=2, micro=2),
        HandLayout("dp2_cp2_ring", dp=2, cp=2), HandLayout("tp2_cp2_ulysses", tp=2, cp=2, cp_algo="ulysses")],
    8: [HandLayout("dp2_tp2_pp2", dp=2, tp=2, pp=2, micro=2)],
}
SETTINGS = dict(preset="tiny", seq_len=32, global_batch=8, steps=3, seed=1234)
# The tiny CPU config's optimizer (TrainConfig's defaults: lr, AdamW, clipping), its warmup and decay shortened for
# runs of a few steps.
TRAIN = dataclasses.replace(TrainConfig(), warmup_steps=2, decay_steps=20)
REFERENCE = HandLayout("single")
RESUME_AT = 1  # the step the resumes start from: two steps are trained after it


@dataclass(frozen=True)
class Resume:
    """A run saved under layout `source` at step RESUME_AT, resumed under `target` (both names of LAYOUTS);
    `reset_moments` zeroes the AdamW moments on the way (a resume done wrong, which must not equal the source)."""
    source: str
    target: str
    reset_moments: bool = False

    @property
    def name(self) -> str:
        return f"resume_{self.source}_to_{self.target}" + ("_moments_reset" if self.reset_moments else "")


# By the launch they run in: a launch of 4 workers resumes a 4-worker run on 2 of them (the others wait).
RESUMES = {2: [Resume("dp2", "tp2"), Resume("tp2", "pp2_1f1b"), Resume("zero2", "dp2"),
               Resume("dp2", "tp2", reset_moments=True)],
           4: [Resume("dp2_tp2", "dp2")]}
# The activation-memory probe: MindSpore prints its memory pool's peak when a process ends, so each layout measured
# has a launch of its own (the CPU backend gathers only on the world group), one step at a sequence long
# enough for the norm tensors sequence parallelism splits (8 x 256 x 256 floats = 2 MiB each) to stand out of the
# pool's 1 MiB print resolution. tp2_whole_vocab is tp2 with the embedding and the head kept whole on each worker:
# what the vocabulary-parallel head and loss save. cp2_ring and cp2_ulysses: each worker's activations of half of
# every sequence (at seq 256, 2 x 2 chunks of 64 tokens).
MEMORY_LAYOUTS = [HandLayout("single"), HandLayout("tp2", tp=2), HandLayout("sp2", tp=2, sp=True),
                  HandLayout("tp2_whole_vocab", tp=2, vocab=False), HandLayout("cp2_ring", cp=2),
                  HandLayout("cp2_ulysses", cp=2, cp_algo="ulysses")]
MEMORY_SETTINGS = dict(SETTINGS, seq_len=256, steps=1)


@dataclass(frozen=True)
class RankResult:
    """One worker's result of one layout, as `train_layout` writes it to OUT/<layout>/rank<r>.json and `from_json`
    reads it back; its final weights are beside it (weights_rank<r>.npz), attached by whoever loads them."""
    layout: HandLayout
    rank: int
    dtype: str  # the numpy dtype the worker computed in
    losses: tuple[float, ...]  # the global loss of each step (every worker reports it)
    grad_norms: tuple[float, ...]  # the global gradient norm of each step, before clipping
    held: Held  # bytes this worker kept
    traffic: dict[Op, Sent]  # what it sent over the whole run, per collective
    pipeline: tuple[StageStep, ...]  # per step, a pipeline stage's record (none off the pipeline)
    seconds: float  # the run's wall time on this worker
    io_bytes: int  # bytes its read and write system calls moved during the run (/proc/self/io)
    ring: tuple[RingStep, ...] = ()  # per ring step, the attention work it computed and the time (ring only)
    weights: dict = field(default_factory=dict, compare=False, repr=False)  # name -> array; not in the JSON

    @property
    def place(self) -> Place:
        return self.layout.place(self.rank)

    @property
    def sent_bytes(self) -> float:
        """Bytes sent as the CPU stand-ins ran, every collective together."""
        return sum(s.sent_bytes for s in self.traffic.values())

    @property
    def ideal_sent_bytes(self) -> float:
        """Bytes the real collectives send, every collective together."""
        return sum(s.ideal_bytes for s in self.traffic.values())

    def to_json(self) -> str:
        return json.dumps({"layout": asdict(self.layout), "rank": self.rank, "dtype": self.dtype,
                           "losses": self.losses, "grad_norms": self.grad_norms, "held": asdict(self.held),
                           "traffic": {str(k): v._asdict() for k, v in self.traffic.items()},
                           "pipeline": [p._asdict() for p in self.pipeline], "seconds": self.seconds,
                           "io_bytes": self.io_bytes, "ring": [r._asdict() for r in self.ring]})

    @classmethod
    def from_json(cls, path: Path) -> RankResult:
        """The result in `path`; a LabkitError naming the file and the keys when a record in it is not one this
        code writes (a key missing or unknown: written by other code, so the run is stale; a layout rebuilt
        from defaults would be another layout) or a traffic name is not an `Op`."""
        def keys(what: str, got: dict, want) -> dict:
            missing, unknown = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            if missing or unknown:
                raise LabkitError(f"{path}: {what} is not one this code writes: missing {missing or 'nothing'}, "
                                  f"unknown {unknown or 'nothing'}",
                                  "delete its folder and run the layouts again (parallel_lab.parallel_runs('run'))")
            return got

        names = lambda kind: [f.name for f in dataclasses.fields(kind) if f.name != "weights"]  # noqa: E731
        d = keys("the rank result", json.loads(Path(path).read_text()), names(cls))
        return cls(HandLayout(**keys("its layout", d["layout"], names(HandLayout))), d["rank"], d["dtype"],
                   tuple(d["losses"]), tuple(d["grad_norms"]), Held(**keys("its bytes held", d["held"], names(Held))),
                   {op_named(k, str(path)): Sent(**keys(f"its count of {k}", v, Sent._fields))
                    for k, v in d["traffic"].items()},
                   tuple(StageStep(**{**keys("a pipeline record", p, StageStep._fields),
                                      "timeline": tuple(map(tuple, p["timeline"]))}) for p in d["pipeline"]),
                   d["seconds"], d["io_bytes"],
                   tuple(RingStep(**keys("a ring step", r, RingStep._fields)) for r in d["ring"]))


def model_cfg(settings: dict = SETTINGS):
    return model_preset(settings["preset"])


def step_batches(layout: HandLayout, dp_index: int, settings: dict = SETTINGS, start_step: int = 0):
    """Per optimizer step from `start_step` on, the list of micro-batches (token ids [b, s+1]) this data-parallel
    index reads."""
    dataset = ensure_dataset(settings["seq_len"], progress=False)
    mb = settings["global_batch"] // (layout.dp * layout.micro)
    it = make_loader(dataset, mb, seed=settings["seed"], dp_size=layout.dp, dp_rank=dp_index, accum=layout.micro,
                     start_step=start_step)
    while True:
        yield [next(it) for _ in range(layout.micro)]


def groups_of(layout: HandLayout, rank: int, world: int, traffic: Traffic) -> dict:
    """This rank's groups (HandLayout.members), made with MindSpore's communication (alone: one-worker groups)."""
    members = layout.members(rank)
    if world == 1:
        return {k: Group("none", 1, 0, (0,), traffic) for k in members}
    return {k: make_group(v, rank, world, traffic) for k, v in members.items()}


def train_layout(layout: HandLayout, rank: int, world: int, out: Path, settings: dict = SETTINGS,
                 dtype=np.float32, save_at: tuple = (), start: dict | None = None) -> RankResult:
    """Train `layout` as worker `rank`; save a checkpoint after each step of `save_at` (OUT/<layout>/ckpt/step_<n>);
    from the full state `start` (reshard.merge's) when given, at its step and data position, else from the seed."""
    cfg = model_cfg(settings)
    layout.check(cfg, settings["global_batch"])
    traffic = Traffic()
    groups = groups_of(layout, rank, world, traffic)
    kind = OptimizerParallel if layout.opt_level else Worker
    worker = kind(cfg, layout, start["weights"] if start else scratch.init(cfg, settings["seed"]), rank, groups,
                  TRAIN, dtype)
    first = 0
    if start:  # this rank's slice of the weights, moments and step; the data from the step it stopped at
        shards.load_worker(worker, shards.rank_tensors(start, cfg, layout, rank))
        first = start["samples"] // settings["global_batch"]
    batches = step_batches(layout, layout.place(rank).dp, settings, first)
    steps, t0 = [], time.time()
    io0 = io_bytes()
    for step in range(first, settings["steps"]):
        micro = next(batches)
        row = pipeline_step(worker, micro) if layout.pp > 1 else worker.train_step(micro)
        steps.append(row)
        if step + 1 in save_at:
            shards.save_worker(worker, out / layout.name / "ckpt" / f"step_{step + 1}", step + 1,
                               (step + 1) * settings["global_batch"])
    io = io_bytes() - io0
    ring = worker.hooks.ring_steps() if isinstance(worker.hooks, ContextParallel) else ()
    result = RankResult(layout, rank, np.dtype(dtype).name, tuple(r["loss"] for r in steps),
                        tuple(r["grad_norm"] for r in steps), worker.bytes_held(), traffic.counts(),
                        tuple(r["stage"] for r in steps if "stage" in r), time.time() - t0, io, ring)
    where = out / layout.name
    where.mkdir(parents=True, exist_ok=True)
    np.savez(where / f".weights_rank{rank}.tmp.npz", **worker.weights())
    os.replace(where / f".weights_rank{rank}.tmp.npz", where / f"weights_rank{rank}.npz")
    atomic_write_text(where / f"rank{rank}.json", result.to_json())
    return result


def saves(layout: HandLayout, settings: dict = SETTINGS) -> tuple:
    """The steps a layout of the launches saves a checkpoint at: the last, and RESUME_AT for a resume's source."""
    sources = {r.source for rs in RESUMES.values() for r in rs}
    return (RESUME_AT, settings["steps"]) if layout.name in sources else (settings["steps"],)


def resume_layout(r: Resume, rank: int, world: int, out: Path, settings: dict = SETTINGS) -> RankResult:
    """Resume `r`: the source's checkpoint of step RESUME_AT merged by hand, trained on under the target layout
    (named r.name) to the last step."""
    state = reshard.merge(reshard.read(out / r.source / "ckpt" / f"step_{RESUME_AT}"))
    if r.reset_moments:
        state = {**state, "adam_m": {n: np.zeros_like(a) for n, a in state["adam_m"].items()},
                 "adam_v": {n: np.zeros_like(a) for n, a in state["adam_v"].items()}}
    target = dataclasses.replace(layouts()[r.target], name=r.name)
    return train_layout(target, rank, world, out, settings, start=state)


def layouts() -> dict[str, HandLayout]:
    return {lay.name: lay for n in sorted(LAYOUTS) for lay in LAYOUTS[n]}


def barrier() -> None:
    """Every worker of the launch waits here for the others (an all-reduce on the world group)."""
    import mindspore as ms
    from mindspore import ops

    ops.AllReduce()(ms.Tensor(np.ones(1, np.float32))).asnumpy()


def _context():
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.byhand.runs")
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
            train_layout(layout, rank, world, out, save_at=saves(layout))
    if not wanted:  # the resumes read checkpoints every worker wrote above
        barrier()
        for r in RESUMES.get(world, []):
            if rank < layouts()[r.target].workers:
                resume_layout(r, rank, world, out)
        barrier()
    if world == 2 and not wanted:  # start-up is paid: the two references run here, one per worker, side by side
        dtype = ("float32", "float64")[rank]
        train_layout(HandLayout(f"single_{dtype}"), 0, 1, out, dtype=np.dtype(dtype).type)  # a world of one
    return 0


if __name__ == "__main__":
    sys.exit(main())
