"""A sharded checkpoint (labkit.byhand.shards) read back, checked, merged into the full state and cut again for
another layout: by hand, and with MindSpore's own offline tool on the same files.

    ckpt = read(DIR)                    every rank's record and strategy, checked (ranks, step, sizes, sha256)
    state = merge(ckpt)                 by hand: the full weights, AdamW moments, step and data position
    state = merge_with_mindspore(DIR)   mindspore.parallel.transform_checkpoints to one rank, then unflattened
    write(OUT, state, cfg, LAYOUT)      the state cut for LAYOUT's ranks (shards.rank_tensors), one rank_* each

The merge by hand, for each tensor of a stage: the strategy file gives the device matrix [dp, cp, tp], the tensor
map and the optimizer-shard group; a rank's coordinates in the matrix say which piece it holds along each split
dimension (`shards.piece_index`); pieces of the same index (replicas over dp and cp) are read once. A flat buffer
(ZeRO's, optimizer parallel's) comes out whole and padded: `unflatten` drops the padding and cuts it back into the
tensors it packs, as the record lists them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.byhand import shards
from labkit.byhand.worker import HandLayout
from labkit.config import ModelConfig, load
from labkit.errors import LabkitError
from labkit.io import atomic_dir
from labkit.model import scratch
from labkit.training.checkpoint import file_digest
from labkit.weights.convert import ms2hf, write_converted
from labkit.weights.formats import ckpt_index

NUMPY = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "float64": np.float64}


@dataclass
class Checkpoint:
    """A sharded checkpoint as read from its folder: the layout, model, step and every rank's record."""
    root: Path
    layout: HandLayout
    cfg: ModelConfig
    step: int
    samples: int
    records: dict  # MindSpore rank -> its record (shards.write_shard)

    def tensors(self, k: int) -> dict[str, np.ndarray]:
        """Every tensor of MindSpore rank k's shard."""
        return read_ckpt(self.root / self.records[k]["files"]["ckpt"]["path"])

    def strategy(self, k: int) -> dict:
        return read_strategy(self.root / self.records[k]["files"]["strategy"]["path"])


def read_ckpt(path: Path) -> dict[str, np.ndarray]:
    """A MindSpore checkpoint's tensors (float and int32), read without MindSpore."""
    out = {}
    with open(path, "rb") as f:
        for name, e in ckpt_index(path, any_dtype=True).items():
            parts = []
            for off, n in e.chunks:
                f.seek(off)
                parts.append(np.fromfile(f, dtype=np.uint8, count=n))
            out[name] = np.concatenate(parts).view(NUMPY[e.dtype]).reshape(e.shape)
    return out


def read_strategy(path: Path) -> dict:
    """A strategy file (ParallelStrategyMap protobuf): {"stage": int, "layouts": {name: (device matrix, tensor
    map, opt_weight_shard_size, opt_weight_shard_step)}}."""
    from mindspore.train import node_strategy_pb2 as pb

    m = pb.ParallelStrategyMap()
    try:
        m.ParseFromString(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001  protobuf's DecodeError and friends
        raise LabkitError(f"{path} is not a MindSpore strategy file ({e})", "save the checkpoint again") from None
    out = {}
    for item in m.parallel_layout_item:
        lay = item.parallel_layouts
        out[item.param_name] = (tuple(lay.dev_matrix[0].dim), tuple(lay.tensor_map[0].dim),
                                int(lay.opt_weight_shard_size), int(lay.opt_weight_shard_step))
    return {"stage": int(m.current_stage), "layouts": out}


def piece_of(layout_item: tuple, local: int) -> tuple[tuple, tuple]:
    """(piece index, pieces) per dimension for the stage's rank `local`, from a strategy's layout item alone."""
    return shards.piece_of(*layout_item, local)


def _bad(path: Path, what: str, fix: str) -> LabkitError:
    return LabkitError(f"{path}: {what}", fix)


def read(root: str | Path, verify: bool = True) -> Checkpoint:
    """The checkpoint in `root`, checked: every rank of its layout present, one step, the files' sizes and sha256
    as recorded (`verify`), each strategy's pieces matching the shard's shapes."""
    root = Path(root)
    paths = sorted(root.glob(f"rank_[0-9]*/{shards.PREFIX}*.json"))
    if not paths:
        raise LabkitError(f"{root}: no shard records (rank_<k>/{shards.PREFIX}<k>.json)",
                          "give the folder of one step of a sharded checkpoint (it holds rank_0, rank_1, ...)")
    records = {}
    for p in paths:
        rec = json.loads(p.read_text(encoding="utf-8"))
        if rec.get("format") != shards.FORMAT:
            raise _bad(p, "not a shard record of this lab", "give a checkpoint saved by labkit.byhand.shards")
        records[rec["ms_rank"]] = rec
    first = records[min(records)]
    layout, world = HandLayout(**first["layout"]), first["world"]
    for k in range(world):
        if k not in records:
            raise LabkitError(f"{root / f'rank_{k}'}: rank {k}'s shard is missing ({len(records)} of the {world} "
                              f"ranks of layout '{layout.name}' are there)",
                              f"copy rank_{k}/ from the run (every rank's folder is needed), or use another step")
    steps = {k: r["step"] for k, r in records.items()}
    if len(set(steps.values())) > 1:
        odd = [k for k, s in steps.items() if s != first["step"]]
        raise LabkitError(f"{root}: shards of different steps: rank {min(records)} at step {first['step']}, "
                          + ", ".join(f"rank {k} ({records[k]['files']['ckpt']['path']}) at step {steps[k]}"
                                      for k in odd),
                          "put the shards of one step together (each step has its own folder)")
    cfg = load(ModelConfig, first["model"], "model")
    ckpt = Checkpoint(root, layout, cfg, first["step"], first["samples"], records)
    for k, rec in records.items():
        if verify:
            for kind, f in rec["files"].items():
                path = root / f["path"]
                if not path.is_file():
                    raise _bad(path, f"rank {k}'s {kind} file is missing", "copy it from the run")
                got = file_digest(path)
                if got["bytes"] != f["bytes"] or f["sha256"] and got["sha256"] != f["sha256"]:
                    raise _bad(path, f"damaged: {got['bytes']} bytes, sha256 {got['sha256']}, where its record "
                                     f"says {f['bytes']} bytes, sha256 {f['sha256']}",
                               "copy the file again from the run, or use the checkpoint of another step")
        check_strategy(ckpt, k)
    return ckpt


def check_strategy(ckpt: Checkpoint, k: int) -> None:
    """Rank k's strategy describes its shard: every tensor it lists is in the shard with the shape the full shape
    cut by the strategy gives (the full shape from the model config; a flat buffer's from its record)."""
    rec, path = ckpt.records[k], ckpt.root / ckpt.records[k]["files"]["strategy"]["path"]
    full = {n: s.shape for n, s in shards.specs(ckpt.cfg, ckpt.layout).items()}
    strategy = ckpt.strategy(k)
    local = k % rec["stage_devices"]
    for name, item in strategy["layouts"].items():
        if name not in rec["tensors"] or name not in full:
            raise _bad(path, f"lists '{name}', which rank {k}'s shard does not hold",
                       "use the strategy files saved with these shards")
        _, counts = piece_of(item, local)
        want = [s // c for s, c in zip(full[name], counts)]
        if len(counts) != len(full[name]) or want != rec["tensors"][name]:
            raise _bad(path, f"'{name}' cut by this strategy is {want}, but rank {k}'s shard holds "
                             f"{rec['tensors'][name]}", "use the strategy files saved with these shards")


def unflatten(cfg: ModelConfig, buffers: list[list[str]], flats: dict[int, np.ndarray]) -> dict:
    """Flat padded buffers (whole) -> their tensors by name: the padding dropped, each cut to its shape."""
    shapes, out = scratch.shapes(cfg), {}
    for b, names in enumerate(buffers):
        at = 0
        for n in names:
            size = int(np.prod(shapes[n]))
            out[n] = flats[b][at:at + size].reshape(shapes[n])
            at += size
    return out


def full_state(cfg: ModelConfig, buffers: list, tensors: dict, step: int, samples: int) -> dict:
    """{"weights", "adam_m", "adam_v": {name: array}, "step", "samples"} from whole tensors by saved name (flat
    buffers undone)."""
    out = {"step": step, "samples": samples}
    for kind, key in (("", "weights"), ("adam_m.", "adam_m"), ("adam_v.", "adam_v")):
        flat = {int(n[len(kind + shards.FLAT.format("")):]): a for n, a in tensors.items()
                if n.startswith(kind + shards.FLAT.format(""))}
        plain = {n[len(kind):]: a for n, a in tensors.items() if n.startswith(kind) and shards.FLAT.format("")
                 not in n and n != shards.STEP and (kind or not n.startswith(shards.MOMENTS))}
        out[key] = {**plain, **unflatten(cfg, buffers, flat)} if flat else plain
    return out


def merge(ckpt: Checkpoint) -> dict:
    """The full state of a checkpoint, by hand: per tensor, the pieces of its stage's ranks placed by the strategy
    (replicas read once), then the flat buffers undone (`full_state`)."""
    whole: dict[str, np.ndarray] = {}
    seen: dict[str, set] = {}
    items: dict[str, tuple] = {}  # every tensor's layout item, from the strategy files read once here
    step = None
    for k in sorted(ckpt.records):
        rec, strategy, tensors = ckpt.records[k], ckpt.strategy(k), ckpt.tensors(k)
        local = k % rec["stage_devices"]
        items.update(strategy["layouts"])
        for name, item in strategy["layouts"].items():
            idx, counts = piece_of(item, local)
            if idx in seen.setdefault(name, set()):
                continue  # a replica of a piece already placed
            seen[name].add(idx)
            piece = tensors[name]
            if name not in whole:
                whole[name] = np.empty([s * c for s, c in zip(piece.shape, counts)], piece.dtype)
            whole[name][tuple(slice(i * s, (i + 1) * s) for i, s in zip(idx, piece.shape))] = piece
        step = int(tensors[shards.STEP][0]) if step is None else step
    for name, item in items.items():
        if len(seen[name]) != int(np.prod(piece_of(item, 0)[1])):
            raise LabkitError(f"{ckpt.root}: the pieces of '{name}' do not cover it", "save the checkpoint again")
    whole[shards.STEP] = np.array([step], np.int32)
    return full_state(ckpt.cfg, ckpt.records[0]["flat_buffers"], whole, step, ckpt.samples)


def merge_with_mindspore(ckpt: Checkpoint, work: Path) -> dict:
    """The full state by MindSpore's tool: `merge_pipeline_strategys` joins the ranks' strategy files (one per
    stage is kept), `transform_checkpoints` with no destination strategy writes one merged rank into `work`; the
    flat buffers are then undone by hand (`full_state`)."""
    merged = mindspore_merge(ckpt.root, work)
    tensors = read_ckpt(merged)
    return full_state(ckpt.cfg, ckpt.records[0]["flat_buffers"], tensors, int(tensors[shards.STEP][0]),
                      ckpt.samples)


def mindspore_merge(src: Path, work: Path, strategy: Path | None = None) -> Path:
    """MindSpore's merge of a folder of rank_*/ checkpoints into `work`/merged/rank_0/merged_0.ckpt: the strategy
    (a folder of per-rank or per-stage files, joined by `merge_pipeline_strategys`, or one file; default
    src/strategy) and `transform_checkpoints(src, dst, "merged_", src_strategy_file, None)`. Returns the file."""
    from mindspore.parallel import merge_pipeline_strategys, transform_checkpoints

    strategy = Path(strategy) if strategy else Path(src) / shards.STRATEGY
    if not strategy.exists():
        raise LabkitError(f"{strategy}: no strategy file or folder",
                          "give the strategy folder the run wrote (mindformers: output/strategy) with --strategy")
    work.mkdir(parents=True, exist_ok=True)
    file = strategy
    if strategy.is_dir():
        file = work / "merged_strategy.ckpt"
        merge_pipeline_strategys(str(strategy), str(file))
    try:
        transform_checkpoints(str(src), str(work / "merged"), "merged_", str(file), None)
    except (ValueError, RuntimeError, KeyError, IndexError) as e:
        raise LabkitError(f"{src}: mindspore.parallel.transform_checkpoints refused: {e}",
                          "check that the strategy describes these shards, or merge with --tool lab") from None
    return work / "merged" / "rank_0" / "merged_0.ckpt"


# ------------------------------------------------------------------------------------------ cut for a layout


def check_target(cfg: ModelConfig, layout: HandLayout, state: dict, dst: Path) -> None:
    """The layout must divide the tensors and the batch: what `HandLayout.check` and each worker's shard check say,
    before anything is written to `dst`."""
    batch = state["samples"] // state["step"] if state["step"] else 8
    try:
        layout.check(cfg, batch)
        for r in range(layout.workers):
            scratch.check_shard(cfg, shards.stage_shard(cfg, layout, r))
    except LabkitError as e:
        raise LabkitError(f"{dst}: layout '{layout.name}' cannot hold this checkpoint of model {cfg.name}: {e.what}",
                          f"{e.fix or 'choose another layout'} (nothing was written)") from None
    shapes = scratch.shapes(cfg)
    missing = sorted(set(shapes) - set(state["weights"]))
    if missing:
        raise LabkitError(f"the state lacks {len(missing)} weight(s), e.g. {missing[0]}", "merge a whole checkpoint")


def write(dst: str | Path, state: dict, cfg: ModelConfig, layout: HandLayout, overwrite: bool = False) -> Path:
    """The full `state` cut for every rank of `layout`, written as a sharded checkpoint into `dst` (all or
    nothing: a temporary folder renamed at the end)."""
    check_target(cfg, layout, state, Path(dst))
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        for r in range(layout.workers):
            shards.write_shard(tmp, cfg, layout, r, shards.rank_tensors(state, cfg, layout, r), state["step"],
                               state["samples"])
    return Path(dst)


def to_hf(state: dict, cfg: ModelConfig, dst: str | Path, work: Path) -> Path:
    """The merged weights through the lab's Hugging Face path: a converted MindSpore folder (`write_converted`),
    then `ms2hf` into `dst`."""
    src = write_converted(work / "ms", cfg, state["weights"])
    ms2hf(src, dst)
    return Path(dst)
