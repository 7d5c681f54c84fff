"""Writes that lose nothing: a reader sees the old file (or folder) or the new one, never half of either.

Files go through a temporary sibling that is flushed to disk (fsync) before the rename; folders are built beside
their destination and renamed into place. Both get the permissions an ordinary `open()`/`mkdir()` would give
(0666/0777 less the umask), so run folders on shared storage stay readable by the rest of a team.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from labkit.errors import LabkitError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(dst: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside `dst`; rename it to `dst` only when the block finishes.

    An interrupted write leaves a `.tmp-*` folder that nothing reads, never a complete-looking `dst`. With
    `overwrite`, the old `dst` is first moved aside (`.old-*`), the new one renamed into place, and only then the
    old one deleted: a crash at any moment leaves a complete old or new folder."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise LabkitError(f"output directory {dst} already exists", "choose another --output or delete it first")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dst.name}-", dir=dst.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{dst.name}-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write a file through a temporary sibling, fsync and a rename, so readers never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
