"""Watching a job's processes: msrun puts each worker in its own session, so the supervisor records every process
(pid and start time), notices a worker that died, ends all of them, and reads what the logs say about it. It also
records each rank's memory cgroup and its counters when it first sees the rank, so a rank's death can be checked
against its memory controller afterwards (`memory_death`: an OOM kill since then, never a fault drill)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.training.oom import memory_watch, oom_evidence

# msrun's own report of a failed worker (mindspore/parallel/cluster/process_entity/_api.py, MindSpore 2.9)
MSRUN_WORKER_ERROR = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


# what MindSpore 2.9's init() raises in the scheduler and the workers when the cluster did not gather within
# msrun's --cluster_time_out (mindspore/ccsrc/cluster/init.cc)
CLUSTER_NOT_GATHERED = "Failed to initialize distributed job cluster"
# the scheduler's word for a worker whose heartbeat stopped (its node died or was cut off; meta_server_node.cc)
NODE_TIMED_OUT = re.compile(r"The node: (\d+) is timed out")


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


RUNNING, FINISHED, FAILED, TIMEOUT, INTERRUPTED = "running", "finished", "failed", "timeout", "interrupted"


@dataclass(frozen=True)
class Outcome:
    """What one look at a job found: still running, all finished, a rank (or msrun) failed, timed out, interrupted."""

    state: str  # RUNNING, FINISHED, FAILED, TIMEOUT or INTERRUPTED
    rank: int | None = None  # the failed rank; None = msrun itself, or not a rank's fault
    code: int | None = None  # its exit code (negative = killed by that signal)
    reason: str | None = None  # a sentence, when the state alone does not say it
    first_death: float | None = None  # perf_counter time the first process of the job ended

    @property
    def done(self) -> bool:
        return self.state != RUNNING


class Supervisor:
    """Watches one job: `poll()` looks once and returns an Outcome; `stop()` ends every process of the job.

    `single` means the root process is the only worker (no msrun); otherwise the root is msrun, whose log
    `msrun_log` carries its report of failed workers, and `workers` ranks run on this node from `first_rank`."""

    def __init__(self, root: subprocess.Popen, *, single: bool, first_rank: int = 0, workers: int = 1,
                 msrun_log: Path | None = None, timeout: float | None = None, started: float | None = None,
                 drill_rank: int | None = None):
        self.root, self.single, self.workers, self.msrun_log = root, single, workers, msrun_log
        self.job = Job(root, single, first_rank)
        self.timeout = timeout
        self.started = time.perf_counter() if started is None else started
        self.ended_at: dict[int, float] = {}  # rank -> when this supervisor first saw it gone
        self.drill_rank = drill_rank  # the rank a fault drill makes end itself with SIGKILL (--kill-rank), or None
        self.memory: dict[int, dict] = {}  # rank -> its memory cgroup and counters when first seen (memory_watch)
        self._watch_memory()

    @property
    def ranks(self) -> dict:
        return self.job.ranks

    def poll(self) -> Outcome:
        now = time.perf_counter()
        self.job.refresh()
        self._watch_memory()
        out = self._poll_single(now) if self.single else self._poll_msrun(now)
        if out.state == RUNNING and self.timeout is not None and now - self.started > self.timeout:
            return Outcome(TIMEOUT, reason=f"timed out after {self.timeout:g} s", first_death=now)
        return out

    def _poll_single(self, now: float) -> Outcome:
        code = self.root.poll()
        if code is None:
            return Outcome(RUNNING)
        death = now
        if code != 0:
            return Outcome(FAILED, rank=self.job.first_rank, code=code, first_death=death)
        return Outcome(FINISHED, first_death=death)

    def _poll_msrun(self, now: float) -> Outcome:
        fault = self.cluster_fault(now)
        if fault is not None:
            return fault
        codes = {int(pid): int(c) for pid, c in MSRUN_WORKER_ERROR.findall(read_log(self.msrun_log))}
        by_pid = {p.pid: r for r, p in self.job.ranks.items()}
        for r, p in self.job.ranks.items():
            if self.job.ended(p):
                self.ended_at.setdefault(r, now)
        death = min(self.ended_at.values()) if self.ended_at else None
        if codes:
            pid, code = next(iter(codes.items()))
            return Outcome(FAILED, rank=by_pid.get(pid), code=code, first_death=death)
        if self.root.poll() is not None:  # msrun ended: 0 = it saw every worker exit 0
            if self.root.returncode == 0:
                return Outcome(FINISHED, first_death=death)
            return Outcome(FAILED, code=self.root.returncode, first_death=death or now)  # msrun gave up
        if len(self.ended_at) == self.workers and all(now - t > EXIT_REPORT_S for t in self.ended_at.values()):
            return Outcome(FINISHED, first_death=death)  # every worker exited 0; msrun may still wait for its scheduler
        if self.ended_at and now - min(self.ended_at.values()) > FINISH_GRACE_S:
            first = min(self.ended_at, key=self.ended_at.get)
            return Outcome(FAILED, code=1, first_death=death, reason=(
                f"ranks {sorted(set(self.job.ranks) - set(self.ended_at))} still running {FINISH_GRACE_S:.0f} s "
                f"after rank {first} finished"))
        return Outcome(RUNNING)

    def cluster_fault(self, now: float) -> Outcome | None:
        """What the scheduler (node 0) or this node's workers say about the cluster: it never gathered (a node
        missing), or a rank stopped answering the heartbeat (its node died). MindSpore's processes can take half
        a minute more to exit after saying so: the job is ended at once."""
        logs = self.msrun_log.parent
        sched = log_end(logs / "scheduler.log")
        lost = NODE_TIMED_OUT.findall(sched)
        if lost:
            rank = int(lost[0])
            where = f"node {rank // self.workers}'s " if rank not in self.job.ranks else ""
            return Outcome(FAILED, rank=rank, code=1, first_death=now, reason=(
                f"{where}rank {rank} stopped answering the scheduler's heartbeat (its process or its node ended)"))
        if any(CLUSTER_NOT_GATHERED in text for text in
               [sched] + [log_end(logs / f"worker_{r}.log") for r in self.job.ranks]):
            return Outcome(FAILED, code=1, reason=CLUSTER_NOT_GATHERED, first_death=now)
        return None

    def _watch_memory(self) -> None:
        """Record the memory cgroup and counters of each rank seen for the first time (while its /proc entry lives)."""
        for r, p in self.job.ranks.items():
            if r not in self.memory and p is not None and not self.job.ended(p):
                self.memory[r] = memory_watch(p.pid)

    def memory_death(self, rank: int | None, code: int) -> dict | None:
        """Did `rank` die for lack of memory? `oom.oom_evidence` on its exit code, the end of its log and its memory
        cgroup's counters since this supervisor first saw it. None for no rank, and for the SIGKILL of a fault drill
        (the rank ends itself and says so in its log; stop() comes after the outcome it reports)."""
        log = self.msrun_log.parent / f"worker_{rank}.log" if self.msrun_log else Path("-")
        drill = rank == self.drill_rank and "fault drill: rank" in log_end(log)  # it reached its drill and said so
        if rank is None or (code == -signal.SIGKILL and drill):
            return None
        return oom_evidence(self.memory.get(rank), code, log_tail(log, 40))

    def wait_root(self, seconds: float) -> None:
        """Give msrun up to `seconds` to end by itself (after its workers finished)."""
        deadline = time.perf_counter() + seconds
        while self.root.poll() is None and time.perf_counter() < deadline:
            time.sleep(POLL_S)

    def stop(self) -> list[int]:
        """End every process of the job; returns the pids still alive afterwards (should be none)."""
        self.job.kill_all()
        return sorted(p.pid for p in self.job.alive())

    @property
    def pids(self) -> list[int]:
        return sorted(self.job.procs)


@contextlib.contextmanager
def interrupt_flag():
    """While a job runs, SIGINT (Ctrl-C, a notebook's interrupt button) only sets a flag, which `supervise` turns into
    KeyboardInterrupt at its next look. A KeyboardInterrupt raised by the signal itself lands wherever the main thread
    happens to be, and code that swallows it there (an import, a library's clean-up) left a launch watching a job it
    had been told to end; the flag is seen whatever ran when the signal came. The previous handler comes back after.
    Outside the main thread (no signal handling there) and where SIGINT is ignored (a background job), nothing
    changes."""
    flag = threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else signal.SIG_IGN
    if previous == signal.SIG_IGN:
        yield flag
        return
    signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def supervise(sup: Supervisor, on_tick=None, interrupted: threading.Event | None = None) -> Outcome:
    """Poll until the job is done; `on_tick()` runs after every look (progress, fault drills).
    On KeyboardInterrupt (or `interrupted` set, see `interrupt_flag`) every process is ended and KeyboardInterrupt
    raised."""
    try:
        while True:
            time.sleep(POLL_S)
            if interrupted is not None and interrupted.is_set():
                raise KeyboardInterrupt
            out = sup.poll()
            if on_tick is not None:
                on_tick()
            if out.done:
                return out
    except BaseException:
        sup.stop()
        raise


# framework chatter, blank lines, and a --json worker's error object (it repeats the `labkit train: error:` lines)
_NOISE = re.compile(r" - (INFO|DEBUG|WARNING) - |^\[(INFO|DEBUG|WARNING)\]|^\s*$|^\{\"ok\": false, \"error\": ")


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


def log_end(path: Path, size: int = 16_384) -> str:
    """The last `size` bytes of a log ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


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

