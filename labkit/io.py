"""Writes that lose nothing: a reader sees the old file (or folder) or the new one, never half of either.

Files go through a temporary sibling that is flushed to disk (fsync) before the rename; folders are built beside
their destination and renamed into place. Both get the permissions an ordinary `open()`/`mkdir()` would give
(0666/0777 less the umask), so run folders on shared storage stay readable by the rest of a team.
A full disk or a read-only folder is reported as such (naming the path), and the half-written copy is removed.
Folders written over time (a training run) are guarded by `OutputLock`, one lock file per node rank.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from labkit.errors import LabkitError, LabkitFailure


def disk_error(e: BaseException, path) -> LabkitError | None:
    """The LabkitError a full disk or an unwritable folder should have been, or None for other exceptions.
    Libraries wrap ENOSPC in their own exceptions (MindSpore's checkpoint and MindRecord writers: RuntimeError),
    so the message is read too."""
    code = getattr(e, "errno", None)
    text = str(e)
    if code == errno.ENOSPC or any(m in text for m in ("No space left on device", "No free disk")):
        return LabkitFailure(f"no space left on device while writing {path}; the partial output was removed",
                             f"free space on the filesystem of {Path(path).parent} (`df -h {Path(path).parent}`), "
                             "or write to another --output, then run the command again")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return LabkitError(f"cannot write {path}: {os.strerror(code)}",
                           f"choose an --output in a folder you can write, or fix the permissions of "
                           f"{Path(path).parent}")
    return None


def read_yaml_file(path: str | os.PathLike):
    """Parse a YAML file; not UTF-8, tabs and syntax errors are LabkitErrors naming the file, line and column."""
    import yaml

    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise LabkitError(f"{path} is not UTF-8 (byte 0x{raw[e.start]:02x} on line {line})",
                          "save the file as UTF-8 (e.g. `iconv -f GBK -t UTF-8` or your editor's encoding menu)"
                          ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        tab = "\t" in problem or "\\t" in problem
        fix = ("YAML indents with spaces only: replace the tab with spaces" if tab else
               "fix the YAML syntax there (indentation, a missing ':' or an unclosed quote)")
        raise LabkitError(f"{path}{where}: not valid YAML ({problem})", fix) from None


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where that is not available."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _new_tmp(dst: Path, overwrite: bool) -> Path:
    if dst.exists() and not overwrite:
        raise LabkitError(f"output directory {dst} already exists", "choose another --output or delete it first")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{dst.name}-", dir=dst.parent))
    except OSError as e:
        raise (disk_error(e, dst) or e) from None


def check_output_dir(dst: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse at once, before any slow work, what `atomic_dir(dst, overwrite)` would refuse at the end of it: an
    existing `dst` without overwrite, or a parent folder that cannot be written (read-only, full, no permission)."""
    os.rmdir(_new_tmp(Path(dst), overwrite))


@contextmanager
def atomic_dir(dst: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside `dst`; rename it to `dst` only when the block finishes.

    An interrupted write leaves a `.tmp-*` folder that nothing reads, never a complete-looking `dst`. With
    `overwrite`, the new folder and the old `dst` swap places in one step (Linux renameat2 RENAME_EXCHANGE) and the
    old one is then deleted: a crash at any moment leaves the complete old or the complete new folder at `dst`.
    Where the filesystem cannot exchange, the old `dst` is moved aside (`.old-*`) just before the rename."""
    dst = Path(dst)
    tmp = _new_tmp(dst, overwrite)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        better = disk_error(e, dst)
        if better is not None:
            raise better from None
        raise
    if dst.exists() and exchange(tmp, dst):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        return
    old = None
    if dst.exists():  # no atomic exchange on this filesystem: a short window where dst is absent
        old = Path(tempfile.mkdtemp(prefix=f".old-{dst.name}-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write a file through a temporary sibling, fsync and a rename, so readers never see half of it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise (disk_error(e, path) or e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        better = disk_error(e, path)
        if better is not None:
            raise better from None
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


# ------------------------------------------------------------------------------------ output-folder locks


def lock_name(node_rank: int = 0) -> str:
    """The lock file of one node's writer: two nodes sharing a run folder each hold their own."""
    return f".labkit-lock-node{int(node_rank)}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _ancestors() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().parents()} | {os.getpid()}
    except psutil.Error:
        return {os.getpid()}


class OutputLock:
    """One writer per node rank in an output folder: a lock file naming the process that writes there.

    `acquire()` creates `<folder>/.labkit-lock-node<rank>.json` (O_EXCL) with pid, host, command and start time.
    When the file exists: a holder that is this process or one of its parents (labkit launch -> msrun -> labkit
    train) is us, and the lock is shared; a holder on this host whose pid is gone (killed, SIGKILL) left a stale
    lock, which is taken over; any other holder is refused with a LabkitError naming it and the lock file."""

    def __init__(self, folder: str | os.PathLike, node_rank: int = 0, command: str = "labkit"):
        self.folder, self.node_rank, self.command = Path(folder), node_rank, command
        self.path = self.folder / lock_name(node_rank)
        self.owned = False

    def _record(self) -> dict:
        import socket
        import time

        return {"pid": os.getpid(), "host": socket.gethostname(), "node_rank": self.node_rank,
                "command": self.command, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _holder(self) -> dict | None:
        import json

        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return {}  # half-written by a writer killed at that moment: stale

    def _refuse(self, h: dict):
        raise LabkitError(
            f"output folder {self.folder} is being written by another run: {h.get('command', '?')} (pid "
            f"{h.get('pid')} on {h.get('host')}, node rank {self.node_rank}, since {h.get('started')}); lock file "
            f"{self.path}", "wait for that run to end, or choose another --output; if that process is gone "
            f"(another machine crashed), delete {self.path}")

    def acquire(self) -> "OutputLock":
        import json
        import socket

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise (disk_error(e, self.folder) or e) from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                h = self._holder()
                if h is None:
                    continue  # released meanwhile
                same_host = h.get("host") == socket.gethostname()
                if same_host and h.get("pid") in _ancestors():
                    return self  # held by this process or the launcher that started it
                if h and (not same_host or _alive(int(h.get("pid", 0)))):
                    self._refuse(h)
                self.path.unlink(missing_ok=True)  # stale: its writer is gone
                continue
            except OSError as e:
                raise (disk_error(e, self.path) or e) from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(self._record()) + "\n")
            self.owned = True
            return self
        raise LabkitError(f"could not take the lock {self.path} (it keeps changing)", "try again")

    def release(self) -> None:
        if self.owned:
            self.path.unlink(missing_ok=True)
            self.owned = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def read_json_object(path: str | os.PathLike, what: str | None = None) -> dict:
    """A JSON object from `path`, or a LabkitError naming the file and what it is for: not UTF-8 JSON, or JSON
    that is not an object (a file that is not what its name says)."""
    import json

    path = Path(path)
    fix = f"restore {path.name}{f' ({what})' if what else ''} from the model's original files"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LabkitError(f"{path} is not valid JSON ({e})", fix) from None
    if not isinstance(value, dict):
        raise LabkitError(f"{path} holds a JSON {type(value).__name__}, not an object", fix)
    return value
