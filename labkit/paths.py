"""Where things live. The lab's own files resolve from the repository root, whatever the working
directory (nbval runs in notebooks/, papermill wherever it is called); user paths stay relative to the caller."""
from __future__ import annotations

import glob
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DATA = ROOT / "data"
NOTEBOOKS = ROOT / "notebooks"
RUNS = ROOT / "runs"
_LAB_PREFIXES = ("configs/", "data/", "notebooks/", "runs/")
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"  # one per Ascend NPU the machine has
GPU_DEVICE_FILES = "/dev/nvidia[0-9]*"  # one per NVIDIA GPU


def lab_path(p: str | os.PathLike) -> Path:
    """Resolve a path: absolute stays; an existing caller-relative path wins; `configs/...`, `data/...`,
    `notebooks/...` and `runs/...` fall back to the repository root."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve() if path.exists() else path
    if str(p).replace("\\", "/").startswith(_LAB_PREFIXES):
        return ROOT / path
    return path


def accelerator_device_files() -> list[str]:
    """The device files of this machine's Ascend NPUs and NVIDIA GPUs (none on a CPU-only machine)."""
    return glob.glob(NPU_DEVICE_FILES) + glob.glob(GPU_DEVICE_FILES)
