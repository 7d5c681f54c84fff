"""`labkit ckpt`: the sharded checkpoints of the hand-written layouts (labkit.byhand.shards) inspected, merged into
one rank and cut for another layout (labkit.byhand.reshard).

    labkit ckpt inspect DIR                               layout, step, data position, per rank its tensors
    labkit ckpt merge DIR --out OUT [--tool lab|mindspore] [--hf HF] [--model M]
                                                          the full state as a one-rank checkpoint (and the
                                                          weights as a Hugging Face model: convert's ms2hf)
    labkit ckpt reshard DIR --to LAYOUT --out OUT         the full state cut for LAYOUT's ranks

DIR is one step's folder (rank_0/, rank_1/, ..., strategy/). `merge --tool mindspore` also takes a cluster run's
shards without the lab's records (mindformers: rank_*/ checkpoints and an output/strategy folder, `--strategy`):
MindSpore's transform_checkpoints then writes OUT/merged.ckpt as it merged it."""
from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from labkit.byhand import reshard, runs, shards
from labkit.byhand.worker import HandLayout
from labkit.config import load_run_config, model_preset
from labkit.errors import LabkitError
from labkit.io import atomic_dir, check_output_dir
from labkit.model import scratch
from labkit.output import add_common_flags, emit
from labkit.weights.convert import ms2hf, write_converted

GRID = re.compile(r"(dp|tp|pp|cp)(\d+)")


def layout_named(name: str) -> HandLayout:
    """A layout of the launches (runs.LAYOUTS, or "single"), or a grid spelled like them: dp2_tp2, tp3, pp2."""
    known = {"single": HandLayout("single"), **runs.layouts()}
    if name in known:
        return known[name]
    parts = name.split("_")
    if all(GRID.fullmatch(p) for p in parts):
        grid = {m.group(1): int(m.group(2)) for m in map(GRID.fullmatch, parts)}
        if min(grid.values()) >= 1:
            pp = grid.get("pp", 1)
            return HandLayout(name, **grid, micro=pp if pp > 1 else 1)
    raise LabkitError(f"layout '{name}' is not known",
                      f"use one of {', '.join(known)}, or a grid such as dp2_tp2 (dp, tp, pp, cp and a size)")


def inspect(root: str | Path) -> dict:
    """What a sharded checkpoint holds: layout, step, samples consumed, loss scale, per rank its tensors."""
    ckpt = reshard.read(root)
    ranks = [{"ms_rank": k, "hand_rank": r["hand_rank"], "stage": r["stage"], "tensors": r["tensors"],
              "bytes": sum(f["bytes"] for f in r["files"].values())} for k, r in sorted(ckpt.records.items())]
    first = ckpt.records[min(ckpt.records)]
    return {"root": str(root), "layout": asdict(ckpt.layout), "model": ckpt.cfg.name, "step": ckpt.step,
            "samples": ckpt.samples, "loss_scale": first["loss_scale"], "world": first["world"],
            "device_matrix": shards.dev_matrix(ckpt.layout), "flat_buffers": len(first["flat_buffers"]),
            "ranks": ranks}


def model_named(spec: str):
    """The model of a cluster run's shards, for --hf: a model preset (llama2_7b, tiny, ...) or the run config the
    run was made from (notebook 07's run.yaml, the same run as its mindformers.yaml: its model section)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise LabkitError(f"--model {spec}: no such file", "give the run's run.yaml or a model preset")
        return load_run_config(path).model_config()
    return model_preset(spec)


def merge(root: str | Path, out: str | Path, tool: str = "lab", strategy: str | Path | None = None,
          overwrite: bool = False, hf: str | Path | None = None, model: str | None = None) -> dict:
    """The full state of the checkpoint in `root` written to `out` as a one-rank checkpoint of layout "single",
    merged by hand ("lab") or by MindSpore's transform_checkpoints ("mindspore"), and with `hf` its weights as a
    Hugging Face model too. Shards without the lab's records (a cluster run's) are merged by MindSpore alone into
    out/merged.ckpt; their model (`model`: a preset or the run's run.yaml, `model_named`) is needed for
    `hf`, which then takes the model's weights from the merged file (optimizer states and counters left out)."""
    if tool not in ("lab", "mindspore"):
        raise LabkitError(f"tool '{tool}' is not known", "use --tool lab or --tool mindspore")
    check_output_dir(out, overwrite)
    if hf:
        check_output_dir(hf, overwrite)
    root = Path(root)
    if tool == "mindspore" and not list(root.glob(f"rank_[0-9]*/{shards.PREFIX}*.json")):
        if hf and not model:
            raise LabkitError(f"{root}: shards without the lab's records carry no model configuration for --hf",
                              "give --model (a model preset such as llama2_7b, or the run's run.yaml)")
        cfg = model_named(model) if model else None
        if not list(root.glob("rank_[0-9]*/*.ckpt")):
            raise LabkitError(f"{root}: no rank_<k>/*.ckpt shards", "give the folder that holds rank_0, rank_1, ...")
        with tempfile.TemporaryDirectory() as work, atomic_dir(out, overwrite) as tmp:
            merged = reshard.mindspore_merge(root, Path(work), Path(strategy) if strategy else None)
            shutil.copyfile(merged, tmp / "merged.ckpt")
            tensors = reshard.read_ckpt(tmp / "merged.ckpt")
            if hf:  # the model's weights (its names and shapes checked by write_converted), then ms2hf
                names = scratch.shapes(cfg)
                weights = {n: a for n, a in tensors.items() if n in names}
                ms2hf(write_converted(Path(work) / "ms", cfg, weights), hf, overwrite=overwrite)
        return {"out": str(out), "tool": tool, "records": False, "tensors": {n: list(a.shape)
                                                                             for n, a in tensors.items()},
                "hf": str(hf) if hf else None}
    ckpt = reshard.read(root)
    if tool == "lab":
        state = reshard.merge(ckpt)
    else:
        with tempfile.TemporaryDirectory() as work:
            state = reshard.merge_with_mindspore(ckpt, Path(work))
    reshard.write(out, state, ckpt.cfg, HandLayout("single"), overwrite)
    if hf:
        with tempfile.TemporaryDirectory() as work:  # the lab's HF path: a converted folder, then ms2hf
            ms2hf(write_converted(Path(work) / "ms", ckpt.cfg, state["weights"]), hf, overwrite=overwrite)
    return {"out": str(out), "tool": tool, "records": True, "from": ckpt.layout.name, "step": state["step"],
            "samples": state["samples"], "weights": len(state["weights"]), "moments": 2 * len(state["adam_m"]),
            "hf": str(hf) if hf else None}


def reshard_to(root: str | Path, to: str, out: str | Path, overwrite: bool = False) -> dict:
    """The checkpoint in `root` merged by hand and cut for layout `to`, written to `out`."""
    layout = layout_named(to)
    check_output_dir(out, overwrite)
    ckpt = reshard.read(root)
    state = reshard.merge(ckpt)
    reshard.write(out, state, ckpt.cfg, layout, overwrite)
    return {"out": str(out), "from": ckpt.layout.name, "to": layout.name, "ranks": layout.workers,
            "step": state["step"], "samples": state["samples"]}


def add_cli(parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    i = sub.add_parser("inspect", help="layout, step and per-rank tensors of a sharded checkpoint")
    i.add_argument("dir", help="one step's folder: rank_0/, rank_1/, ..., strategy/")
    add_common_flags(i)
    i.set_defaults(func=_cli_inspect)
    m = sub.add_parser("merge", help="merge the shards into one full checkpoint (weights, moments, step)")
    m.add_argument("dir", help="one step's folder: rank_0/, rank_1/, ..., strategy/")
    m.add_argument("--out", required=True, help="folder to write (atomically)")
    m.add_argument("--tool", default="lab", choices=("lab", "mindspore"),
                   help="merge by hand (lab) or with mindspore.parallel.transform_checkpoints (default: lab)")
    m.add_argument("--strategy", default=None,
                   help="--tool mindspore: a strategy file, or a folder of per-stage files (default: DIR/strategy)")
    m.add_argument("--hf", default=None, help="also write the merged weights as a Hugging Face model here")
    m.add_argument("--model", default=None, help="shards without the lab's records (a cluster run's), for --hf: "
                                                 "a model preset (llama2_7b, ...) or the run's run.yaml (notebook 07)")
    m.add_argument("--overwrite", action="store_true", help="replace --out (and --hf) if it exists")
    add_common_flags(m)
    m.set_defaults(func=_cli_merge)
    r = sub.add_parser("reshard", help="cut the full state for another layout's ranks")
    r.add_argument("dir", help="one step's folder: rank_0/, rank_1/, ..., strategy/")
    r.add_argument("--to", required=True, metavar="LAYOUT", help="a layout name (dp2, tp2, pp2_1f1b, zero2, dp2_tp2, ...)")
    r.add_argument("--out", required=True, help="folder to write (atomically)")
    r.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    add_common_flags(r)
    r.set_defaults(func=_cli_reshard)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _cli_inspect(args) -> int:
    r = inspect(args.dir)
    lines = [f"{r['root']}: layout {r['layout']['name']} ({r['world']} ranks, device matrix [dp, cp, tp] = "
             f"{r['device_matrix']}, {r['layout']['pp']} stage(s)), model {r['model']}, step {r['step']}, "
             f"{r['samples']} samples consumed, loss scale {r['loss_scale']['kind']}"]
    for rank in r["ranks"]:
        lines.append(f"rank_{rank['ms_rank']} (hand rank {rank['hand_rank']}, stage {rank['stage']}, "
                     f"{rank['bytes']} bytes): {len(rank['tensors'])} tensors")
        lines += [f"  {n} {shape}" for n, shape in rank["tensors"].items()]
    emit(args, {"ok": True, **r}, "\n".join(lines))
    return 0


def _cli_merge(args) -> int:
    r = merge(args.dir, args.out, args.tool, args.strategy, args.overwrite, args.hf, args.model)
    emit(args, {"ok": True, **r}, f"merged {args.dir} with {r['tool']} into {r['out']}")
    return 0


def _cli_reshard(args) -> int:
    r = reshard_to(args.dir, args.to, args.out, args.overwrite)
    emit(args, {"ok": True, **r}, f"{r['from']} -> {r['to']} ({r['ranks']} ranks), step {r['step']}: {r['out']}")
    return 0
