"""Where things live. The lab's own files resolve from the repository root, whatever the working
directory (nbval runs in notebooks/, papermill wherever it is called); user paths stay relative to the caller."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
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


@contextmanager
def atomic_dir(dst: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside `dst`; rename it to `dst` only when the block finishes.
    An interrupted write leaves a `.tmp-*` folder that nothing reads, never a complete-looking `dst`."""
    import shutil

    from .errors import LabkitError

    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise LabkitError(f"output directory {dst} already exists", "choose another --output or delete it first")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dst.name}-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the finished folder gets the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a file through a temporary sibling and a rename, so readers never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
