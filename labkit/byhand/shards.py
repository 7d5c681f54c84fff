"""Sharded checkpoints of the hand-written layouts: each worker saves what it holds, in MindSpore's own files, so
that MindSpore's offline tools (`mindspore.parallel.transform_checkpoints`, `merge_sliced_parameter`, ...) and the
lab's by-hand merge (labkit.byhand.reshard) read the same shards.

A checkpoint of a layout at a step is one folder:

    rank_<k>/shard_<k>.ckpt     MindSpore rank k's tensors (mindspore.save_checkpoint): the weights as held, the
                                AdamW moments `adam_m.<name>` and `adam_v.<name>` (mindformers' names), the
                                optimizer step `global_step` (int32 [1])
    rank_<k>/shard_<k>.json     its record: layout, model, step, samples consumed, loss scale, the hand rank,
                                every tensor's shape, and the size and sha256 of the two files below/beside it
    strategy/ckpt_strategy_rank_<k>.ckpt
                                how the tensors lie over the ranks, a `ParallelStrategyMap` protobuf
                                (mindspore.train.node_strategy_pb2), one per rank as mindformers writes them

Rank numbering. MindSpore's tools count ranks stage-major: rank // (devices per stage) is the pipeline stage
(`_transform_checkpoints`, `_convert_to_list`); `HandLayout` puts data parallel outermost,
rank = ((dp * pp + stage) * cp + cp_i) * tp + tp_i. The folders use MindSpore's number (`ms_rank`):
k = stage * (dp * cp * tp) + (dp_i * cp + cp_i) * tp + tp_i; the record says which hand rank wrote it.

The strategy. Per stage the device matrix is [dp, cp, tp] (its product: the devices of one stage); a tensor map
entry per tensor dimension names the device axis that splits it, counted from the right as MindSpore does
(tp 0, cp 1, dp 2; -1 whole): tensor parallel's column-parallel matrices (and a vocabulary-parallel embedding and
head) [0, -1], its row-parallel ones [-1, 0], everything else -1 per dimension (replicated over dp and cp).
`current_stage` and the strategy item's `stage` carry the pipeline stage; a stage's file lists its own tensors
(`mindspore.parallel.merge_pipeline_strategys` joins the stages' files, naming each tensor "<stage>-<name>").
ZeRO and optimizer parallel keep a 1/dp slice of flat padded buffers (labkit.byhand.data_parallel.Buckets), not of
each tensor: each buffer is saved as one 1-D tensor, `flat_buffer.<b>` (weights, optimizer parallel only) and
`adam_m.flat_buffer.<b>`/`adam_v.flat_buffer.<b>`, its full shape the padded length, described as MindSpore
describes its own optimizer shard: tensor map [-1], `opt_weight_shard_size` dp, `opt_weight_shard_step` cp * tp
(the stride between the ranks of one optimizer-shard group). Which tensors a buffer packs, in order, is in the
record (`flat_buffers`): merging undoes the padding and the flattening (reshard.unflatten).

The workers train in float32 without a loss scale: the record says so (`loss_scale`: kind none, value 1.0)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.byhand.optimizer_parallel import units
from labkit.byhand.worker import HandLayout, stage_shard
from labkit.config import ModelConfig, to_dict
from labkit.io import atomic_write_bytes, atomic_write_text
from labkit.model import scratch
from labkit.training.checkpoint import file_digest

PREFIX = "shard_"  # rank_<k>/shard_<k>.ckpt: MindSpore's tools glob rank_[0-9]*/*.ckpt
STRATEGY = "strategy"
STEP = "global_step"
FLAT = "flat_buffer.{}"
MOMENTS = ("adam_m.", "adam_v.")
LOSS_SCALE = {"kind": "none", "value": 1.0}  # float32 training, no loss scaling
FORMAT = "labkit-shard-1"


@dataclass(frozen=True)
class Spec:
    """One saved tensor and how it lies over the ranks of its pipeline stage."""
    name: str
    shape: tuple  # full shape (a flat buffer: its padded length)
    tensor_map: tuple  # per dimension, the device axis splitting it (tp 0, cp 1, dp 2), -1: whole
    stage: int
    opt_shard: int = 0  # > 0: dimension 0 split again over this many ranks (the optimizer-shard group)


def dev_matrix(layout: HandLayout) -> list[int]:
    """The device matrix of one pipeline stage: [dp, cp, tp]."""
    return [layout.dp, layout.cp, layout.tp]


def stage_devices(layout: HandLayout) -> int:
    return layout.dp * layout.cp * layout.tp


def ms_rank(layout: HandLayout, rank: int) -> int:
    """MindSpore's (stage-major) number of hand rank `rank`."""
    p = layout.place(rank)
    return p.pp * stage_devices(layout) + (p.dp * layout.cp + p.cp) * layout.tp + p.tp


def hand_rank(layout: HandLayout, k: int) -> int:
    """The hand rank of MindSpore rank k (`ms_rank`'s inverse)."""
    stage, local = divmod(k, stage_devices(layout))
    dp, rest = divmod(local, layout.cp * layout.tp)
    cp, tp = divmod(rest, layout.tp)
    return layout.rank_at(dp, stage, tp, cp)


def flat_buffers(cfg: ModelConfig, layout: HandLayout) -> list[list[str]]:
    """The names each flat buffer packs, in order: ZeRO's one buffer of every parameter, optimizer parallel's one
    per unit; none for the other layouts."""
    if layout.opt_level:
        return units(cfg)
    if layout.zero:
        return [scratch.names(cfg)]
    return []


def flat_length(cfg: ModelConfig, names: list[str], dp: int) -> int:
    """A flat buffer's padded length: its tensors' elements rounded up to a multiple of dp (data_parallel.Flat)."""
    shapes = scratch.shapes(cfg)
    size = sum(int(np.prod(shapes[n])) for n in names)
    return -(-size // dp) * dp


def tensor_map(name: str, shard: scratch.Shard, ndim: int) -> tuple:
    if shard.splits(name):
        return (0, -1) if scratch.split_by_rows(name, shard.vocab_parallel) else (-1, 0)
    return (-1,) * ndim


def specs(cfg: ModelConfig, layout: HandLayout) -> dict[str, Spec]:
    """Every saved tensor of the layout (but the step) by name, with its full shape and placement."""
    shapes, out = scratch.shapes(cfg), {}
    buffers = flat_buffers(cfg, layout)
    for b, names in enumerate(buffers):
        n = (flat_length(cfg, names, layout.dp),)
        if layout.opt_level:
            out[FLAT.format(b)] = Spec(FLAT.format(b), n, (-1,), 0, layout.dp)
        for m in MOMENTS:
            out[m + FLAT.format(b)] = Spec(m + FLAT.format(b), n, (-1,), 0, layout.dp)
    for stage in range(layout.pp):
        shard = stage_shard(cfg, layout, layout.rank_at(0, stage, 0))
        for name in scratch.names(cfg, shard):
            tm = tensor_map(name, shard, len(shapes[name]))
            if not layout.opt_level:
                out[name] = Spec(name, shapes[name], tm, stage)
            if not buffers:
                for m in MOMENTS:
                    out[m + name] = Spec(m + name, shapes[name], tm, stage)
    return out


def opt_step(layout: HandLayout) -> int:
    """The stride between the ranks of one optimizer-shard group: the dp axis is outermost in [dp, cp, tp]."""
    return layout.cp * layout.tp


def piece_of(dev: list, tmap: tuple, opt_size: int, opt_step: int, local: int) -> tuple[tuple, tuple]:
    """(which piece per dimension, pieces per dimension) that rank `local` of a stage holds of a tensor laid out by
    a device matrix, a tensor map (axes counted from the right) and an optimizer-shard group (size, stride): its
    coordinates in the device matrix, row-major, pick the piece along each split dimension; the optimizer shard
    cuts dimension 0 again by the rank's place in its group."""
    coords = np.unravel_index(local, dev) if len(dev) else ()
    idx = [0 if a == -1 else int(coords[len(dev) - 1 - a]) for a in tmap]
    counts = [1 if a == -1 else int(dev[len(dev) - 1 - a]) for a in tmap]
    if opt_size:
        idx[0], counts[0] = idx[0] * opt_size + (local // max(opt_step, 1)) % opt_size, counts[0] * opt_size
    return tuple(idx), tuple(counts)


def piece_index(spec: Spec, layout: HandLayout, local: int) -> tuple[tuple, tuple]:
    """`piece_of` for a saved tensor of `layout`."""
    return piece_of(dev_matrix(layout), spec.tensor_map, spec.opt_shard, opt_step(layout) if spec.opt_shard else 0,
                    local)


def piece_shape(spec: Spec, layout: HandLayout) -> tuple:
    _, counts = piece_index(spec, layout, 0)
    return tuple(s // c for s, c in zip(spec.shape, counts))


def cut(full: np.ndarray, idx: tuple, counts: tuple) -> np.ndarray:
    """Piece `idx` of a tensor cut into `counts` equal pieces per dimension."""
    sl = tuple(slice(i * (s // c), (i + 1) * (s // c)) for i, s, c in zip(idx, full.shape, counts))
    return full[sl]


def pack(tensors: dict, names: list[str], length: int) -> np.ndarray:
    """Full tensors -> one flat vector of `length` (data_parallel.Flat.pack: flattened in order, zero-padded)."""
    flat = np.concatenate([np.asarray(tensors[n]).reshape(-1) for n in names])
    return np.concatenate([flat, np.zeros(length - flat.size, flat.dtype)])


def rank_tensors(full: dict, cfg: ModelConfig, layout: HandLayout, rank: int) -> dict[str, np.ndarray]:
    """What hand rank `rank` of `layout` holds of a full state (`full`: {"weights", "adam_m", "adam_v": {name:
    full array}, "step": int}), by saved name: the inverse of the merge. Flat buffers are packed from the full
    tensors, then cut."""
    place = layout.place(rank)
    local = (place.dp * layout.cp + place.cp) * layout.tp + place.tp
    groups = {"": full["weights"], "adam_m.": full["adam_m"], "adam_v.": full["adam_v"]}
    buffers = flat_buffers(cfg, layout)
    out = {}
    for name, spec in specs(cfg, layout).items():
        if spec.stage != place.pp:
            continue
        kind = next((m for m in MOMENTS if name.startswith(m)), "")
        base = name[len(kind):]
        if base.startswith(FLAT.format("")):
            b = int(base.rsplit(".", 1)[1])
            whole = pack(groups[kind], buffers[b], spec.shape[0])
        else:
            whole = groups[kind][base]
        out[name] = np.ascontiguousarray(cut(np.asarray(whole), *piece_index(spec, layout, local)))
    out[STEP] = np.array([full["step"]], np.int32)
    return out


# ------------------------------------------------------------------------------------------ a live worker


def worker_tensors(w) -> dict[str, np.ndarray]:
    """What worker `w` (labkit.byhand.worker.Worker or OptimizerParallel) holds, by saved name: its weights as
    held, its optimizer's moments (flat buffers cut per buffer) and step."""
    state, out = w.optimizer.state(), {}
    if w.layout.opt_level:
        starts = w.buckets.starts
        mine = w.mine.asnumpy()
        out.update({FLAT.format(b): mine[starts[b]:starts[b + 1]] for b in range(len(starts) - 1)})
    else:
        out.update({n: p.asnumpy() for n, p in w.params.items()})
    if isinstance(state["m"], dict):
        for key, m in zip(("m", "v"), MOMENTS):
            out.update({m + n: t.asnumpy() for n, t in state[key].items()})
    else:
        starts = (w.buckets if w.layout.opt_level else w.optimizer.buckets).starts
        for key, m in zip(("m", "v"), MOMENTS):
            vec = state[key].asnumpy()
            out.update({m + FLAT.format(b): vec[starts[b]:starts[b + 1]] for b in range(len(starts) - 1)})
    out[STEP] = np.array([state["step"]], np.int32)
    return out


def load_worker(w, tensors: dict[str, np.ndarray]) -> None:
    """Give worker `w` a rank's tensors (`rank_tensors` of its layout and rank): weights, moments and step."""
    import mindspore as ms

    cat = lambda prefix: ms.Tensor(np.concatenate(  # noqa: E731
        [tensors[prefix + FLAT.format(b)] for b in range(len(flat_buffers(w.cfg, w.layout)))]).astype(w.dtype))
    step = int(tensors[STEP][0])
    if w.layout.opt_level:
        w.mine = cat("")
    else:
        for n, p in w.params.items():
            p.set_data(ms.Tensor(tensors[n].astype(w.dtype)))
    if w.layout.opt_level or w.layout.zero:
        w.optimizer.load_state({"m": cat(MOMENTS[0]), "v": cat(MOMENTS[1]), "step": step})
    else:
        w.optimizer.load_state({"m": {n: ms.Tensor(tensors[MOMENTS[0] + n].astype(w.dtype)) for n in w.names},
                                "v": {n: ms.Tensor(tensors[MOMENTS[1] + n].astype(w.dtype)) for n in w.names},
                                "step": step})


# ------------------------------------------------------------------------------------------ the files


def strategy_map(cfg: ModelConfig, layout: HandLayout, stage: int, only: set | None = None):
    """The `ParallelStrategyMap` of one stage: device matrix, tensor map, optimizer-shard group and stage of every
    tensor the stage holds (`only`: of these names alone, e.g. what a rank's shard holds)."""
    from mindspore.train import node_strategy_pb2 as pb

    out = pb.ParallelStrategyMap(current_stage=stage)
    item = out.parallel_strategy_item.add(node_name=f"labkit_byhand_{layout.name}")
    item.parallel_strategys.stage = stage
    item.parallel_strategys.parallel_strategy.add().dim.extend(dev_matrix(layout))
    for name, spec in specs(cfg, layout).items():
        if spec.stage != stage or only is not None and name not in only:
            continue
        layouts = out.parallel_layout_item.add(param_name=name).parallel_layouts
        layouts.dev_matrix.add().dim.extend(dev_matrix(layout))
        layouts.tensor_map.add().dim.extend(spec.tensor_map)
        layouts.param_split_shape.add()
        layouts.indices_offset.add()
        layouts.field = 0
        layouts.opt_weight_shard_step = opt_step(layout) if spec.opt_shard else 0
        layouts.opt_weight_shard_size = spec.opt_shard
    return out


def shard_paths(root: Path, k: int) -> dict[str, Path]:
    return {"ckpt": root / f"rank_{k}" / f"{PREFIX}{k}.ckpt", "record": root / f"rank_{k}" / f"{PREFIX}{k}.json",
            "strategy": root / STRATEGY / f"ckpt_strategy_rank_{k}.ckpt"}


def save_ckpt(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A MindSpore checkpoint written through a hidden temporary file and a rename (MindSpore's tools glob
    rank_*/*.ckpt, which a dot file does not match)."""
    import mindspore as ms

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.ckpt")
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in tensors.items()], str(tmp))
    os.replace(tmp, path)


def write_shard(root: Path, cfg: ModelConfig, layout: HandLayout, rank: int, tensors: dict, step: int,
                samples: int) -> Path:
    """Write hand rank `rank`'s shard of a checkpoint at `step` into `root` (its tensors from `worker_tensors` or
    `rank_tensors`), its strategy file, and last its record (the record's presence says the shard is whole)."""
    k, stage = ms_rank(layout, rank), layout.place(rank).pp
    paths = shard_paths(Path(root), k)
    save_ckpt(paths["ckpt"], tensors)
    atomic_write_bytes(paths["strategy"], strategy_map(cfg, layout, stage).SerializeToString())
    record = {"format": FORMAT, "layout": dataclasses.asdict(layout), "model": to_dict(cfg), "step": step,
              "samples": samples, "loss_scale": LOSS_SCALE, "ms_rank": k, "hand_rank": rank, "stage": stage,
              "stage_devices": stage_devices(layout), "world": layout.workers,
              "flat_buffers": flat_buffers(cfg, layout),
              "tensors": {n: list(a.shape) for n, a in tensors.items()},
              "files": {kind: {"path": str(paths[kind].relative_to(root)), **file_digest(paths[kind])}
                        for kind in ("ckpt", "strategy")}}
    atomic_write_text(paths["record"], json.dumps(record, indent=1))
    return paths["record"]


def save_worker(w, root: Path, step: int, samples: int) -> Path:
    """Worker `w`'s shard at `step` (`samples` consumed so far) into `root` (every worker of the layout calls it)."""
    return write_shard(Path(root), w.cfg, w.layout, w.rank, worker_tensors(w), step, samples)
