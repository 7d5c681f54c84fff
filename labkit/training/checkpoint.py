"""Training checkpoints: the full state needed to continue exactly, written atomically.

A checkpoint is a folder `<output>/checkpoints/step_000012/` holding
- `state.ckpt`: model weights, AdamW moments (`adam_m.*`, `adam_v.*`), the optimizer's `global_step` (the
  learning-rate schedule position) and the loss scaler (`loss_scale.value`, `loss_scale.counter`);
- `state.json`: `kind: full`, the step, the data position (samples consumed), RNG seed, config and metrics so far.
It is written into `.tmp-step_...` and renamed when complete, so a crash never leaves a checkpoint that looks whole.
`state.json` also records the size and sha256 of `state.ckpt` (sha256 up to HASH_LIMIT bytes), so a checkpoint
damaged later (a disk error, a copy cut short) is recognised: `--resume` then falls back to the newest good one and
says which it skipped and why (`load_newest_good`).
Weights-only files (a `labkit convert` output, a bare `.ckpt`) can initialise a run but not resume one.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from labkit.errors import LabkitError
from labkit.io import atomic_dir
# the folder layout (checkpoints/step_NNNNNN with state.json + state.ckpt) lives with the other formats
from labkit.weights.formats import checkpoint_dir, latest, list_checkpoints, step_of, weights_file  # noqa: F401

KIND = "full"
HASH_LIMIT = 2 * 2**30  # state.ckpt files above this get a size check only (hashing 80 GB would take minutes)


def file_digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex or None above HASH_LIMIT} of a file, read in 1 MiB chunks."""
    size = path.stat().st_size
    if size > HASH_LIMIT:
        return {"bytes": size, "sha256": None}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


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
        record = {"kind": KIND, "step": step, **meta, "state_ckpt": file_digest(tmp / "state.ckpt")}
        (tmp / "state.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    for old in list_checkpoints(output)[:-keep] if keep else []:
        gone = old.with_name(f".del-{old.name}")  # renamed first: a kill mid-delete leaves no half checkpoint
        old.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
    return dst


def load_full(path: Path) -> tuple[dict, dict]:
    """(parameter dict, metadata) of a full checkpoint; refuses weights-only files and damaged checkpoints with the
    reason (state.json unreadable, state.ckpt missing, of the wrong size or sha256, or unparsable)."""
    import mindspore as ms

    meta = verify(path)
    state = Path(path) / "state.ckpt"
    try:
        params = ms.load_checkpoint(str(state))
    except (RuntimeError, ValueError, OSError, TypeError) as e:
        raise LabkitError(f"{state} cannot be read: {str(e).strip().splitlines()[0][:200]}") from None
    return params, meta


def verify(path: Path) -> dict:
    """The metadata of a full checkpoint whose state.ckpt matches its record (size, and sha256 where recorded),
    without loading it; a LabkitError naming what is wrong otherwise."""
    path = Path(path)
    meta_file = path / "state.json"
    if path.is_file() or not meta_file.is_file():
        raise LabkitError(
            f"{path} is not a full training checkpoint (no state.json with optimizer, step and data position)",
            "weights-only files initialise a run: use train.init_checkpoint; --resume needs a folder written by "
            "labkit train under <output>/checkpoints/")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LabkitError(f"{meta_file} is damaged (not valid JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise LabkitError(f"{meta_file} is not the record of a full checkpoint (kind "
                          f"{meta.get('kind') if isinstance(meta, dict) else None!r})")
    state = path / "state.ckpt"
    if not state.is_file():
        raise LabkitError(f"{state} is missing")
    recorded = meta.get("state_ckpt") or {}
    if recorded:
        found = file_digest(state) if recorded.get("sha256") else {"bytes": state.stat().st_size, "sha256": None}
        if found != recorded:
            raise LabkitError(f"{state} is damaged: {found['bytes']} bytes"
                              + (f", sha256 {str(found['sha256'])[:12]}..." if found["sha256"] else "")
                              + f", but state.json recorded {recorded.get('bytes')} bytes"
                              + (f", sha256 {recorded['sha256'][:12]}..." if recorded.get("sha256") else ""))
    return meta


def newest_intact(output: Path) -> Path | None:
    """The newest checkpoint that passes `verify` (what --resume will load), or None."""
    for ck in candidates(output):
        try:
            verify(ck)
        except LabkitError:
            continue
        return ck
    return None


def candidates(output: Path) -> list[Path]:
    """Every step_* folder under <output>/checkpoints (complete or not), newest first."""
    root = checkpoint_dir(output)
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()] if root.is_dir() else []
    return sorted(found, key=step_of, reverse=True)


def load_newest_good(output: Path, log=print) -> tuple[Path, dict, dict]:
    """(folder, parameters, metadata) of the newest checkpoint that loads and matches its record. Each newer one
    that does not is named with its reason through `log` ("... falling back to ..."), never used silently."""
    skipped = []
    for ck in candidates(output):
        try:
            params, meta = load_full(ck)
        except LabkitError as e:
            skipped.append(f"{ck.name}: {e.what}")
            log(f"--resume: checkpoint {ck} is unusable ({e.what}); falling back to the previous one")
            continue
        if skipped:
            log(f"--resume: using {ck} (step {meta.get('step')}); skipped {len(skipped)} newer damaged "
                f"checkpoint(s)")
        return ck, params, meta
    raise LabkitError(f"--resume: no usable checkpoint under {checkpoint_dir(output)} ({'; '.join(skipped)})"
                      if skipped else f"--resume: no complete checkpoint under {checkpoint_dir(output)}",
                      "run without --resume to start over, or point --output at the earlier run")


def load_weights(path: str | Path) -> dict:
    """Model weights from a converted directory (`model.ckpt`), a full checkpoint folder or a `.ckpt` file."""
    import mindspore as ms

    found = weights_file(path)
    if found is not None:
        params = ms.load_checkpoint(str(found))
        return {k: v for k, v in params.items() if not k.startswith(("adam_", "loss_scale.", "global_step",
                                                                       "learning_rate"))}
    raise LabkitError(f"init_checkpoint {path} not found",
                      "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
