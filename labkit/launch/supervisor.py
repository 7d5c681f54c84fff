"""Watching a job's processes: msrun puts each worker in its own session, so the supervisor records every process
(pid and start time), notices a worker that died, ends all of them, and reads what the logs say about it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


# msrun's own report of a failed worker (mindspore/parallel/cluster/process_entity/_api.py, MindSpore 2.9)
MSRUN_WORKER_ERROR = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


POLL_S = 0.25  # how often the launcher looks at the workers


EXIT_REPORT_S = 3.0  # msrun polls every second; a worker gone this long without msrun's error line exited 0


FINISH_GRACE_S = 60.0  # after one rank finished cleanly, the others must finish within this


class Job:
    """The process tree of one launch: the root (msrun or the single worker) and everything below it."""

    def __init__(self, root: subprocess.Popen, single: bool, first_rank: int):
        import psutil

        self.root, self.single, self.first_rank = root, single, first_rank
        self.procs: dict[int, psutil.Process] = {}
        self.ranks: dict[int, psutil.Process] = {}  # rank -> worker process
        self.scheduler = None
        try:
            self.procs[root.pid] = psutil.Process(root.pid)
        except psutil.NoSuchProcess:
            pass
        if single:
            self.ranks[first_rank] = self.procs.get(root.pid)

    def refresh(self):
        import psutil

        root = self.procs.get(self.root.pid)
        if root is None:
            return
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        known = {p.pid for p in self.ranks.values() if p is not None} | {getattr(self.scheduler, "pid", None)}
        for c in children:
            self.procs.setdefault(c.pid, c)
            if self.single or c.pid in known:
                continue
            try:  # msrun's direct children, classified by the environment msrun gave them (re-read until exec)
                if c.ppid() != root.pid:
                    continue
                env = c.environ()
            except psutil.Error:
                continue
            if env.get("MS_ROLE") == "MS_WORKER" and (env.get("MS_NODE_ID") or env.get("RANK_ID")):
                self.ranks[int(env.get("MS_NODE_ID") or env["RANK_ID"])] = c
            elif env.get("MS_ROLE") == "MS_SCHED":
                self.scheduler = c

    @staticmethod
    def ended(p) -> bool:
        import psutil

        try:
            return (not p.is_running()) or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def alive(self) -> list:
        return [p for p in self.procs.values() if not self.ended(p)]

    def kill_all(self, timeout: float = 10.0):
        """SIGKILL every process of the job (each worker's own session group too) and wait until all are gone."""
        import psutil

        self.refresh()
        for p in list(self.ranks.values()) + ([self.scheduler] if self.scheduler else []):
            if p is not None and not self.ended(p):
                try:
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.root.poll() is None:
            try:
                os.killpg(self.root.pid, signal.SIGKILL)  # msrun, its scheduler and helpers (own session)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.alive():
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(list(self.procs.values()), timeout=timeout)
        try:
            self.root.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


_NOISE = re.compile(r" - (INFO|DEBUG|WARNING) - |^\[(INFO|DEBUG|WARNING)\]|^\s*$")


def log_tail(path: Path, lines: int = 15) -> str:
    """The informative end of a worker log: from its last Traceback, else its last lines (framework INFO dropped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return f"(no log at {path})"
    rows = [r.split("\r")[-1].rstrip() for r in raw.splitlines()]
    rows = [r for r in rows if not _NOISE.search(r)]
    tb = max((i for i, r in enumerate(rows) if r.startswith("Traceback")), default=None)
    if tb is not None:
        return "\n".join(rows[tb:][-40:])
    return "\n".join(rows[-lines:]) if rows else "(no error in the log: the process was ended from outside)"


def summary_from_log(path: Path) -> dict | None:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def start_guard(job_root: int) -> subprocess.Popen | None:
    """A separate process that ends the job if this launcher dies without cleaning up (kernel killed)."""
    try:
        return subprocess.Popen([sys.executable, "-m", "labkit.launch", "guard", str(os.getpid()), str(job_root)],
                                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def read_log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def guard(parent_pid: int, root_pid: int) -> None:
    """`python -m labkit.launch guard PARENT ROOT`: end ROOT's process tree if PARENT dies first."""
    import psutil

    try:
        parent, root = psutil.Process(parent_pid), psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return
    known = {root.pid: root}
    while True:
        try:
            for c in root.children(recursive=True):
                known.setdefault(c.pid, c)
        except psutil.Error:
            pass
        alive = [p for p in known.values() if not Job.ended(p)]
        if not alive:
            return
        if not parent.is_running():
            for p in alive:
                try:
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.kill()
                except (OSError, psutil.Error):
                    pass
            return
        time.sleep(0.5)
