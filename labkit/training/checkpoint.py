"""Training checkpoints: the full state needed to continue exactly, written atomically.

A checkpoint is a folder `<output>/checkpoints/step_000012/` holding
- `state.ckpt`: model weights, AdamW moments (`adam_m.*`, `adam_v.*`), the optimizer's `global_step` (the
  learning-rate schedule position) and the loss scaler (`loss_scale.value`, `loss_scale.counter`);
- `state.json`: `kind: full`, the step, the data position (samples consumed), RNG seed, config and metrics so far.
It is written into `.tmp-step_...` and renamed when complete, so a crash never leaves a checkpoint that looks whole.
Weights-only files (a `labkit convert` output, a bare `.ckpt`) can initialise a run but not resume one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from labkit.errors import LabkitError
from labkit.io import atomic_dir

KIND = "full"


def checkpoint_dir(output: Path) -> Path:
    return Path(output) / "checkpoints"


def step_of(path) -> int:
    """The step a checkpoint folder holds, from its name `step_000012`."""
    name = Path(path).name
    try:
        return int(name.split("_", 1)[1])
    except (IndexError, ValueError):
        raise LabkitError(f"{path} is not a checkpoint folder (its name is not step_NNNNNN)") from None


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / "state.json").is_file() and (p / "state.ckpt").is_file()]
    return sorted(done, key=step_of)


def save(output: Path, step: int, params: list, meta: dict, keep: int) -> Path:
    """Write checkpoint `step` from (name, Parameter) pairs; keep the newest `keep`."""
    import mindspore as ms

    dst = checkpoint_dir(output) / f"step_{step:06d}"
    with atomic_dir(dst, overwrite=True) as tmp:
        seen, items = set(), []
        for name, p in params:
            if name not in seen:
                seen.add(name)
                items.append({"name": name, "data": p})
        ms.save_checkpoint(items, str(tmp / "state.ckpt"))
        (tmp / "state.json").write_text(json.dumps({"kind": KIND, "step": step, **meta}, indent=1, default=str),
                                        encoding="utf-8")
    for old in list_checkpoints(output)[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return dst


def latest(output: Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1] if found else None


def load_full(path: Path) -> tuple[dict, dict]:
    """(parameter dict, metadata) of a full checkpoint; refuses weights-only files with the reason."""
    import mindspore as ms

    path = Path(path)
    meta_file = path / "state.json"
    if path.is_file() or not meta_file.is_file():
        raise LabkitError(
            f"{path} is not a full training checkpoint (no state.json with optimizer, step and data position)",
            "weights-only files initialise a run: use train.init_checkpoint; --resume needs a folder written by "
            "labkit train under <output>/checkpoints/")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("kind") != KIND:
        raise LabkitError(f"{meta_file} has kind {meta.get('kind')!r}, not a full checkpoint")
    return ms.load_checkpoint(str(path / "state.ckpt")), meta


def load_weights(path: str | Path) -> dict:
    """Model weights from a converted directory (`model.ckpt`), a full checkpoint folder or a `.ckpt` file."""
    import mindspore as ms

    path = Path(path)
    for candidate in (path, path / "model.ckpt", path / "state.ckpt"):
        if candidate.is_file():
            params = ms.load_checkpoint(str(candidate))
            return {k: v for k, v in params.items() if not k.startswith(("adam_", "loss_scale.", "global_step",
                                                                           "learning_rate"))}
    raise LabkitError(f"init_checkpoint {path} not found",
                      "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
