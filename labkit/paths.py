"""Where things live. The lab's own files resolve from the repository root, whatever the working
directory (nbval runs in notebooks/, papermill wherever it is called); user paths stay relative to the caller."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DATA = ROOT / "data"
NOTEBOOKS = ROOT / "notebooks"
RUNS = ROOT / "runs"
_LAB_PREFIXES = ("configs/", "data/", "notebooks/", "runs/")


def lab_path(p: str | os.PathLike) -> Path:
    """Resolve a path: absolute stays; an existing caller-relative path wins; `configs/...`, `data/...`,
    `notebooks/...` and `runs/...` fall back to the repository root."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve() if path.exists() else path
    if str(p).replace("\\", "/").startswith(_LAB_PREFIXES):
        return ROOT / path
    return path
