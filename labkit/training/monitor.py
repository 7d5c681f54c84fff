"""Memory troubleshooting: run a command under a memory cap, tell an out-of-memory death from other deaths (and say
what the planner predicted), search for the largest micro-batch that fits, and watch process RSS step by step for
a slow leak. Also where no cap of ours is involved: a process's memory cgroup read while it lives and again at its
death names an OOM kill (`memory_watch`, `oom_evidence`; the launcher asks it about every rank), with the knobs to
turn (`memory_knobs`); `labkit train` typed on a command line is watched by a parent process that does the same
(`train_watched`).

The cap is a memory cgroup made for the child alone: cgroup v1 (`memory.limit_in_bytes` under the caller's own
group) or cgroup v2 (`memory.max`); where neither is writable, RLIMIT_AS, which counts address space rather than
resident memory (MindSpore maps ~2 GB of address space at import against ~0.4 GB resident), so that limit is the
RSS cap plus a measured address-space baseline (`address_overhead_mb`).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from labkit.errors import LabkitError

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
# Text an allocator prints when it cannot get memory (CPU malloc, MindSpore's pool, Ascend/GPU device memory).
ALLOCATOR_TEXT = re.compile(r"std::bad_alloc|Cannot allocate memory|Out of memory|out of memory|Malloc.*fail|"
                            r"Allocate memory failed|[Mm]emory (?:is )?not enough|memory isn't enough|"
                            r"Failed to alloc|ENOMEM")
# MindSpore's PIPELINE module logs the start and the end of every graph compilation at INFO level; with only that
# module at INFO (the rest stays at GLOG_v) a dead process's stderr says whether it died compiling or running.
COMPILE_LOG_ENV = {"MS_SUBMODULE_LOG_v": "{PIPELINE:1}"}
_COMPILE_EVENT = re.compile(r"PIPELINE\(\d+,\w+,\w+\):(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d)\.(\d{3})\.(\d{3}) "
                            r".*PrintEventMessage\] (Start|End) compiling '([^']+)'")


# ------------------------------------------------------------------------------------------- RSS and leaks


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of a process (default: this one), MB, from /proc/<pid>/status."""
    try:
        text = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(m.group(1)) / 1024 if m else float("nan")


class LeakMonitor:
    """An `on_step` callback: records RSS after each step (`rec["rss_mb"]`) and fits a straight line to it.

    A healthy loop allocates the same tensors every step, so after the first steps (graph compile, kernel tuning,
    allocator pools filling: `skip`) resident memory is flat up to page-level noise. Memory kept from every step
    (a growing list of tensors, a history that holds device buffers) shows as a constant slope. The alert is a
    slope above `threshold_mb_per_step` sustained over at least `min_steps` fitted steps.

    Some steps are followed by work that allocates once: an evaluation (its graph compiles on first use) or a
    checkpoint save (serialisation buffers the allocator keeps). The trainer marks them with `one_off(step)`; the
    RSS change from a marked step to the next is replaced by the median change of the unmarked steps before the fit
    (a steady leak keeps its slope, a flat loop stays flat). Unmarked, such jumps read as a leak: the tiny model's
    40-step run with an evaluation at step 20 and saves every 10 steps grew 11, 23 and 1.3 MB right after steps 10,
    20 and 30 and not at all between them, a fitted 1.25 MB/step."""

    def __init__(self, skip: int = 5, threshold_mb_per_step: float = 1.0, min_steps: int = 8):
        self.skip, self.threshold, self.min_steps = skip, threshold_mb_per_step, min_steps
        self.steps: list[int] = []
        self.rss: list[float] = []
        self.marked: set[int] = set()

    def __call__(self, rec: dict) -> None:
        rec["rss_mb"] = round(rss_mb(), 2)
        self.steps.append(int(rec["step"]))
        self.rss.append(rec["rss_mb"])

    def one_off(self, step: int) -> None:
        """Work after `step` allocates once (evaluation, checkpoint save): leave its RSS change out of the trend."""
        self.marked.add(int(step))

    def _series(self) -> tuple[list[int], list[float]]:
        """The fitted steps and their RSS with every marked step's change replaced by the unmarked median."""
        import statistics

        xs, ys = self.steps[self.skip:], self.rss[self.skip:]
        changes = [(x, b - a) for x, a, b in zip(xs, ys, ys[1:])]
        usual = [d for x, d in changes if x not in self.marked]
        if not usual or len(usual) == len(changes):
            return xs, ys
        typical = statistics.median(usual)
        adjusted = ys[:1]
        for x, d in changes:
            adjusted.append(adjusted[-1] + (typical if x in self.marked else d))
        return xs, adjusted

    def report(self) -> dict:
        xs, ys = self._series()
        n = len(xs)
        if n < self.min_steps:
            return {"fitted_steps": n, "slope_mb_per_step": None, "flagged": False,
                    "message": f"{n} steps after the first {self.skip}: too few to judge a memory trend "
                               f"(need {self.min_steps})"}
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        flagged = slope > self.threshold
        skipped = sorted(x for x in self.marked if xs[0] <= x < xs[-1])
        msg = (f"RSS grows {slope:.2f} MB per step over steps {xs[0]}-{xs[-1]} "
               f"({self.rss[self.skip]:.0f} -> {self.rss[-1]:.0f} MB"
               + (f"; one-off changes after steps {', '.join(map(str, skipped))} left out)" if skipped else ")"))
        if flagged:
            msg += (f": above {self.threshold:g} MB/step, a leak (something keeps memory from every step: "
                    f"tensors appended to a list in a callback, a history holding device buffers, growing caches)")
        return {"fitted_steps": n, "slope_mb_per_step": round(slope, 3), "threshold_mb_per_step": self.threshold,
                "rss_first_mb": self.rss[self.skip], "rss_last_mb": self.rss[-1], "flagged": flagged, "message": msg}


# ------------------------------------------------------------------------------------------- memory caps


def cap_method() -> str:
    """How `run_capped` will limit memory here: 'cgroup-v1', 'cgroup-v2' or 'rlimit'."""
    if _v1_parent() is not None:
        return "cgroup-v1"
    if _v2_parent() is not None:
        return "cgroup-v2"
    return "rlimit"


def _group_of(controller: str, pid: int | str = "self") -> str | None:
    """A process's cgroup path for a v1 `controller` ("" = the v2 unified hierarchy), from /proc/<pid>/cgroup."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(",") or (controller == "" and ctrls == ""):
                return path
    except OSError:
        pass
    return None


def _v1_parent() -> Path | None:
    if not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        return None
    own = _group_of("memory")
    for parent in ([CGROUP_V1 / own.lstrip("/")] if own else []) + [CGROUP_V1]:
        if parent.is_dir() and os.access(parent, os.W_OK):
            return parent
    return None


def _v2_parent() -> Path | None:
    own = _group_of("")
    if own is None or not (CGROUP_V2 / "cgroup.controllers").exists():
        return None
    parent = CGROUP_V2 / own.lstrip("/")
    ok = parent.is_dir() and os.access(parent, os.W_OK) and "memory" in (parent / "cgroup.subtree_control").read_text()
    return parent if ok else None


def _make_group(method: str, limit_mb: float) -> Path | None:
    if method == "rlimit":
        return None
    parent = _v1_parent() if method == "cgroup-v1" else _v2_parent()
    group = parent / f"labkit_cap_{os.getpid()}_{time.monotonic_ns()}"
    group.mkdir()
    limit = str(int(limit_mb * 2**20))
    if method == "cgroup-v1":
        (group / "memory.limit_in_bytes").write_text(limit)
        if (group / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
            (group / "memory.memsw.limit_in_bytes").write_text(limit)
    else:
        (group / "memory.max").write_text(limit)
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
    return group


def _group_stats(method: str, group: Path | None) -> dict:
    if group is None:
        return {}

    def read(name):
        try:
            return (group / name).read_text()
        except OSError:
            return ""

    if method == "cgroup-v1":
        oom = dict(line.split() for line in read("memory.oom_control").splitlines() if line.strip())
        return {"failcnt": int(read("memory.failcnt") or 0), "oom_kills": int(oom.get("oom_kill", 0)),
                "peak_mb": int(read("memory.max_usage_in_bytes") or 0) / 2**20}
    events = dict(line.split() for line in read("memory.events").splitlines() if line.strip())
    peak = read("memory.peak").strip()
    return {"failcnt": int(events.get("max", 0)), "oom_kills": int(events.get("oom_kill", 0)),
            "peak_mb": int(peak) / 2**20 if peak.isdigit() else None}


def run_capped(cmd: list[str], limit_mb: float, *, env: dict | None = None, timeout: float = 1800,
               method: str | None = None, address_overhead_mb: float = 2200.0) -> dict:
    """Run `cmd` with its memory capped at `limit_mb`; return how it ended, with the cgroup's counters."""
    method = method or cap_method()
    group = _make_group(method, limit_mb)

    def enter():  # runs in the child between fork and exec, so every byte it allocates is counted
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        else:
            import resource

            cap = int((limit_mb + address_overhead_mb) * 2**20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    start = time.perf_counter()
    timeline: list[tuple[float, float]] = []  # (unix time, MB charged to the group), sampled while it runs
    done = threading.Event()
    sampler = threading.Thread(target=_sample, args=(method, group, timeline, done), daemon=True)
    try:
        sampler.start()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=enter)
        done.set()
        sampler.join()
        stats = _group_stats(method, group)
    finally:
        done.set()
        if group is not None:
            _remove_group(group)
    return {"cmd": cmd, "limit_mb": limit_mb, "method": method, "returncode": p.returncode,
            "seconds": round(time.perf_counter() - start, 1), "stdout": p.stdout, "stderr": p.stderr,
            "timeline": timeline, **stats}


def _sample(method: str, group: Path | None, out: list, done: threading.Event, every: float = 0.05) -> None:
    """Memory charged to the cgroup every `every` seconds until `done` (nothing to read under RLIMIT_AS)."""
    if group is None:
        return
    name = "memory.usage_in_bytes" if method == "cgroup-v1" else "memory.current"
    while not done.wait(every):
        try:
            out.append((time.time(), int((group / name).read_text()) / 2**20))
        except (OSError, ValueError):
            pass


def _remove_group(group: Path) -> None:
    for _ in range(50):  # the cgroup empties a moment after the child is reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def classify_death(result: dict) -> dict:
    """Was this an out-of-memory death, and how do we know? Reads the exit status, the cgroup counters and the
    last lines of stderr."""
    rc, err = result["returncode"], result.get("stderr", "")
    sig = -rc if rc < 0 else None
    tail = "\n".join(err.strip().splitlines()[-40:])
    found = ALLOCATOR_TEXT.search(tail)
    if rc == 0:
        return {"out_of_memory": False, "how": "exited normally", "evidence": "return code 0"}
    if sig == signal.SIGKILL and (result.get("oom_kills", 0) > 0 or result.get("kernel_log")):
        return {"out_of_memory": True, "how": "killed by the kernel's OOM killer (SIGKILL)",
                "evidence": _kill_evidence(result)}
    if "MemoryError" in tail:
        return {"out_of_memory": True, "how": "Python MemoryError", "evidence": _line_with(tail, "MemoryError")}
    if found:
        return {"out_of_memory": True, "how": "allocator failure", "evidence": _line_with(tail, found.group(0))}
    if sig == signal.SIGKILL:
        return {"out_of_memory": None, "how": "SIGKILL with no cgroup record",
                "evidence": "the host OOM killer is the usual sender: `dmesg | grep -i 'killed process'` tells"}
    return {"out_of_memory": False, "how": f"exit {rc}" + (f" (signal {signal.Signals(sig).name})" if sig else ""),
            "evidence": tail.splitlines()[-1] if tail else "no output"}


def _kill_evidence(result: dict) -> str:
    """Where an OOM kill is recorded: the memory cgroup's counter (with its limit) and/or the kernel log."""
    said = []
    if result.get("oom_kills", 0) > 0:
        limit = result.get("limit_mb")
        where = f" {result['group']}" if result.get("group") else ""
        said.append(f"memory cgroup{where}: {result['oom_kills']} OOM kill(s) "
                    + (f"at its {limit:.0f} MB limit" if limit else "with no memory limit of its own (the machine's "
                                                                    "memory ran out)")
                    + (f", {result['failcnt']} failed charges" if result.get("failcnt") else ""))
    if result.get("kernel_log"):
        said.append(f"kernel log: {result['kernel_log'][:200]}")
    return "; ".join(said)


def _line_with(text: str, needle: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if needle in line), needle)[:300]


# ------------------------------------------------------------------------------------------- who killed a process
# A process killed with SIGKILL cannot say why. The kernel's OOM killer counts each kill in the memory controller of
# the victim's cgroup (v2: `oom_kill` in memory.events, also in every ancestor; v1: `oom_kill` in memory.oom_control,
# beside memory.failcnt) and logs "Killed process <pid>" in the kernel log. `memory_watch` records a live process's
# group and its counters; `oom_evidence` reads them again at its death, so only a kill since then is blamed (an older
# OOM kill in the same group is not), and asks the kernel log about the pid where it is readable (root).


def memory_group(pid: int | str = "self") -> tuple[str, Path] | None:
    """('cgroup-v1' or 'cgroup-v2', folder) of the memory cgroup a process is in; None without one (or when gone)."""
    v1 = _group_of("memory", pid)
    if v1 is not None and (CGROUP_V1 / "memory.oom_control").exists():
        group = CGROUP_V1 / v1.lstrip("/")
        return ("cgroup-v1", group) if group.is_dir() else None
    v2 = _group_of("", pid)
    if v2 is not None and (CGROUP_V2 / "cgroup.controllers").exists():
        group = CGROUP_V2 / v2.lstrip("/")
        return ("cgroup-v2", group) if (group / "memory.events").exists() else None
    return None


def group_limit_mb(method: str, group: Path) -> float | None:
    """The memory limit a cgroup lives under: the lowest one set on it or an ancestor, MB; None when unlimited."""
    root, name = (CGROUP_V1, "memory.limit_in_bytes") if method == "cgroup-v1" else (CGROUP_V2, "memory.max")
    limits = []
    for g in [group, *group.parents]:
        if g != root and root not in g.parents:
            break
        try:
            text = (g / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**62:  # v1 writes "unlimited" as ~2^63, v2 as "max"
            limits.append(int(text) / 2**20)
    return min(limits, default=None)


def host_memory_mb() -> float | None:
    """The machine's RAM (MemTotal), MB."""
    try:
        m = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def memory_watch(pid: int) -> dict:
    """What `oom_evidence` needs at a process's death, read while it lives: its memory cgroup and the cgroup's
    counters now (after its death /proc/<pid> is gone)."""
    found = memory_group(pid)
    method, group = found if found else (None, None)
    return {"pid": pid, "since": time.monotonic(), "method": method, "group": group,
            "before": _group_stats(method, group)}


def oom_evidence(watch: dict | None, returncode: int, stderr: str = "") -> dict:
    """`classify_death` of a process seen by `memory_watch`: the rise of its cgroup's OOM-kill and failed-charge
    counters since then, the kernel log's record of its pid (for SIGKILL), the last lines it wrote. Adds `limit_mb`,
    the memory it ran under: its cgroup's limit, else the machine's RAM."""
    watch = watch or {}
    method, group = watch.get("method"), watch.get("group")
    after, before = _group_stats(method, group), watch.get("before") or {}
    rise = {k: max(0, after.get(k, 0) - before.get(k, 0)) for k in ("oom_kills", "failcnt")}
    limit = group_limit_mb(method, group) if group else None
    root = CGROUP_V1 if method == "cgroup-v1" else CGROUP_V2
    result = {"returncode": returncode, "stderr": stderr, **rise, "limit_mb": limit,
              "group": "/" + str(group.relative_to(root)).lstrip(".") if group else None}
    if returncode == -signal.SIGKILL and watch.get("pid"):
        result["kernel_log"] = kernel_oom_line(watch["pid"], watch.get("since", 0.0))
    return {**classify_death(result), "limit_mb": limit or host_memory_mb()}


_KILLED = re.compile(r"Killed process (\d+) \(")


def kernel_oom_line(pid: int, since: float = 0.0) -> str | None:
    """The kernel log's line on the OOM killer killing `pid` at or after monotonic time `since`; None when there is
    none or the log is not readable here (/dev/kmsg needs root, or kernel.dmesg_restrict=0)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        for _ in range(1_000_000):  # one record per read, oldest first, until none is left
            try:
                head, _, msg = os.read(fd, 8192).decode("utf-8", "replace").partition(";")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while we read; the next read goes on from the oldest left
                continue
            m = _KILLED.search(msg)
            fields = head.split(",")
            if m and int(m.group(1)) == pid and len(fields) > 2 and int(fields[2]) / 1e6 >= since - 1.0:
                found = msg.strip()
    finally:
        os.close(fd)
    return found


def planner_need_mb(cfg, micro_batch: int | None = None, *, seq_len: int | None = None,
                    recompute: str | None = None) -> dict:
    """The planner's memory need of one worker of run config `cfg` (its micro-batch, seq_len and recompute unless
    given), MB by part: `labkit.parallel.memory` as notebook 08 quotes it on CPU (fp32, no flash attention, unfused
    norm; recompute "all" counts as full recomputation, anything else as none). Not counted: MindSpore's own memory
    (libraries, graph compilation, allocator pools)."""
    from labkit.parallel.memory import memory_breakdown

    t, par = cfg.train, cfg.parallel
    parts = memory_breakdown(cfg.model_config(), seq_len=seq_len or cfg.data.seq_len,
                             micro_batch=micro_batch or t.micro_batch, accum=t.accum, dp=par.dp or 1, mp=par.mp,
                             pp=par.pp, optimizer_shard=par.optimizer_shard, precision="fp32", flash_attention=False,
                             recompute="full" if (recompute or t.recompute) == "all" else "none", fused_norm=False)
    return {k: round(v * 1024, 1) for k, v in parts.items() if k not in ("stage", "params")}


def memory_knobs(cfg, limit_mb: float | None) -> str:
    """What to turn after a run of `cfg` ran out of `limit_mb` MB (micro-batch, recompute, sequence length), each with
    the planner's figure. Command-line flags of `labkit train` and `labkit launch` alike."""
    t, seq = cfg.train, cfg.data.seq_len
    need = planner_need_mb(cfg)
    state = need["weights"] + need["gradients"] + need["optimizer"]
    limit = f" against the {limit_mb:.0f} MB limit" if limit_mb else ""
    knobs = [_micro_batch_knob(cfg, need["total"], limit_mb)]
    if t.recompute != "all":
        knobs.append(f"--set train.recompute=all ({planner_need_mb(cfg, recompute='all')['total']:.0f} MB)")
    if seq > 1:
        knobs.append(f"--set data.seq_len={seq // 2} ({planner_need_mb(cfg, seq_len=seq // 2)['total']:.0f} MB)")
    return (f"the planner counts {need['total']:.0f} MB per worker at micro-batch {t.micro_batch} and seq_len {seq} "
            f"(activations {need['activations']:.0f} MB, weights + gradients + optimizer states {state:.0f} MB; "
            f"MindSpore's own memory, its libraries, graph compilation and allocator pools, comes on top){limit}. "
            f"Knobs: {'; '.join(knobs)}; or a higher memory limit")


def _micro_batch_knob(cfg, need_mb: float, limit_mb: float | None) -> str:
    mb, keep = cfg.train.micro_batch, "raising --accum keeps the global batch"
    if not limit_mb or need_mb <= limit_mb:
        return (f"halve --micro-batch until it fits ({keep}): the planner's count at {mb} is under the limit, so "
                f"MindSpore's own memory made the difference")
    fits = max((m for m in range(1, mb) if planner_need_mb(cfg, m)["total"] <= limit_mb), default=0)
    if not fits:
        return "--micro-batch 1 is over the limit even by the planner's count"
    return (f"--micro-batch {fits} or less ({planner_need_mb(cfg, fits)['total']:.0f} MB, the largest the planner "
            f"fits under the limit; MindSpore's own memory comes on top, so halve from there; {keep})")


# ------------------------------------------------------------------------------------------- `labkit train` watched
# A process killed with SIGKILL cannot report itself. `labkit train` typed on a command line (not a worker msrun
# started, not main([...]) inside a notebook or test) therefore forks before it imports MindSpore: the child trains;
# the parent (Python, labkit's CLI and numpy: ~43 MB resident, shared copy-on-write with the child, ~18 MB of it its
# own while the child trains) waits, names a SIGKILL with `oom_evidence` and `memory_knobs` as the launcher does,
# and ends as the child ended: its exit code, or by the same signal, so whoever reads the exit status (notebook 08's
# capped runs, the launcher's one-worker job, the fault drills) sees what it saw before. No second interpreter starts
# and nothing is imported twice. Ctrl-C reaches both (one process group): the child stops cleanly, the parent waits;
# SIGTERM and SIGHUP sent to the parent are passed on; the child gets SIGKILL if the parent dies.


def train_watched(cfg, args) -> int | None:
    """`labkit train` from a command line: fork. Returns None in the child, which trains; the parent returns the
    child's exit code, or ends by the signal that ended the child, after naming a SIGKILL (out of memory or not)."""
    if not _command_line_train():
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _die_with(parent)
        return None
    watch = memory_watch(pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child too: it stops, then so do we
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _frame: _send(pid, s))
    try:  # outlive a cgroup v2 group kill (memory.oom.group) to report it; only root may lower the score
        Path("/proc/self/oom_score_adj").write_text("-1000")
    except OSError:
        pass
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code >= 0:
        return code
    if code == -signal.SIGKILL:
        _report_kill(watch, cfg, args)
    _end_by(-code)
    return 128 - code  # not reached: _end_by does not return


def _command_line_train() -> bool:
    if any(os.environ.get(k) for k in ("MS_ROLE", "RANK_ID", "MS_NODE_ID")):  # msrun's worker: the launcher watches
        return False
    prog = Path(sys.argv[0])
    return sys.argv[1:2] == ["train"] and (prog.name == "labkit" or prog.parts[-2:] == ("labkit", "__main__.py"))


def _die_with(parent: int) -> None:
    """In the child: SIGKILL when the parent dies (PR_SET_PDEATHSIG), so ending the started command ends training."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


def _end_by(sig: int) -> None:
    """End this process by signal `sig`, as the child ended (without a core file of our own: the child wrote its)."""
    import resource

    sys.stdout.flush()
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if sig != signal.SIGKILL:  # which has no handler to reset
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to end a process


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _report_kill(watch: dict, cfg, args) -> None:
    """The parent's word on a child killed with SIGKILL (not for the fault drill, which kills itself)."""
    from labkit.errors import LabkitFailure
    from labkit.output import run_error
    from labkit.training.metrics import read_metrics

    death = oom_evidence(watch, -signal.SIGKILL)
    if not death["out_of_memory"] and getattr(args, "kill_rank", None) is not None:
        return
    steps = max([0] + [r.get("step", 0) for r in read_metrics(Path(cfg.output_dir))])
    who = (f"the training process (pid {watch['pid']}) was killed by signal SIGKILL after {steps} of "
           f"{cfg.train.steps} steps")
    if death["out_of_memory"]:
        failure = LabkitFailure(f"out of memory: {who}: {death['how']}, {death['evidence']}",
                                memory_knobs(cfg, death["limit_mb"]))
    else:
        failure = LabkitFailure(f"{who}, not by labkit: {death['how']}; {death['evidence']}")
    run_error(args, failure, getattr(args, "json", False))


# ------------------------------------------------------------------------------------------- training probes


def compile_events(stderr: str) -> list[tuple[float, str, str]]:
    """(unix time, 'start' or 'end', graph name) of each graph compilation in a log written with COMPILE_LOG_ENV."""
    from datetime import datetime

    out = []
    for m in _COMPILE_EVENT.finditer(stderr):
        t = datetime.strptime(m.group(1), "%Y-%m-%d-%H:%M:%S").timestamp() + int(m.group(2)) / 1e3 + int(m.group(3)) / 1e6
        out.append((t, m.group(4).lower(), m.group(5)))
    return out


def _mb_at(timeline: list, t: float) -> float | None:
    before = [mb for ts, mb in timeline if ts <= t]
    return round(before[-1]) if before else None


def death_phase(stderr: str, steps_done: int, timeline: list | tuple = ()) -> dict:
    """When a training process died: before any graph compilation (imports, model build), while MindSpore
    compiled a graph, or while running a step; with the memory charged at each compilation's start and end
    (from `run_capped`'s timeline) so a reader sees what compiling cost against what running cost."""
    events = compile_events(stderr)
    compiles = {}
    for t, kind, name in events:
        compiles.setdefault(name, {})[kind + "_mb"] = _mb_at(timeline, t)
    if events and events[-1][1] == "start":
        name = events[-1][2]
        return {"phase": "compile", "graph": name, "compiles": compiles,
                "text": f"while compiling the graph '{name}' (before step {steps_done + 1} ran)"}
    if events or steps_done:
        return {"phase": "step", "step": steps_done + 1, "compiles": compiles,
                "text": f"while running step {steps_done + 1}, after its graph compiled"}
    return {"phase": "setup", "compiles": compiles, "text": "before any graph compilation (imports, model build, data)"}


def train_capped(config: str, micro_batch: int, limit_mb: float, sets: list[str] | tuple = (),
                 timeout: float = 1800, predict=None) -> dict:
    """`labkit train` at one micro-batch in a child process capped at `limit_mb`; how it ended, when (compiling
    or running, `death_phase`) and why. `predict(micro_batch)` gives a memory model's need by part in MB (e.g. the
    planner's, see `labkit.course.troubleshoot.predicted_mb`); the report quotes it."""
    from labkit.config import load_run_config
    from labkit.training.metrics import read_metrics

    sets = [*sets, f"train.micro_batch={micro_batch}"]
    cmd = [sys.executable, "-m", "labkit", "train", "--config", str(config), "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "GLOG_v": os.environ.get("GLOG_v", "3"), **COMPILE_LOG_ENV}
    out = Path(load_run_config(config, list(sets)).output_dir)
    started = time.time()
    result = run_capped(cmd, limit_mb, env=env, timeout=timeout)
    death = classify_death(result)
    fresh = (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_mtime >= started
    phase = death_phase(result["stderr"], len(read_metrics(out)) if fresh else 0, result.get("timeline", ()))
    need = predict(micro_batch) if predict else None
    fits = result["returncode"] == 0
    return {"micro_batch": micro_batch, "fits": fits, "limit_mb": limit_mb, "method": result["method"],
            "seconds": result["seconds"], "peak_mb": result.get("peak_mb"), "death": death, "phase": phase,
            "predicted_mb": need, "report": None if fits else oom_report(death, micro_batch, limit_mb, need, phase),
            "stderr_tail": "\n".join(line for line in result["stderr"].splitlines() if "[INFO]" not in line)[-2000:]}


def oom_report(death: dict, micro_batch: int, limit_mb: float, need: dict | None = None,
               phase: dict | None = None) -> str:
    """What a reader should be told about a dead training process."""
    if not death["out_of_memory"]:
        return f"the process died ({death['how']}), not from lack of memory as far as the evidence shows: " \
               f"{death['evidence']}"
    if phase and phase["phase"] in ("compile", "setup"):
        return (f"out of memory {phase['text']} at micro-batch {micro_batch}: {death['how']} ({death['evidence']}). "
                f"No step ran, so activations are not the cause: compiling a graph costs host memory that grows "
                f"with the graph (layers, operators), not with the batch. Fix: raise the limit above "
                f"{limit_mb:.0f} MB, or make the graph smaller (fewer layers per process: pipeline stages); "
                f"halving train.micro_batch will not help")
    predicted = (f"the planner predicts {need['total']:.0f} MB for weights, gradients, optimizer states and "
                 f"activations ({need['activations']:.0f} MB of it activations), plus the framework's overhead, "
                 f"against a {limit_mb:.0f} MB limit" if need else f"the limit was {limit_mb:.0f} MB")
    when = f" {phase['text']}" if phase else ""
    return (f"out of memory{when} at micro-batch {micro_batch}: {death['how']} ({death['evidence']}). "
            f"Likely cause: activations grow with micro_batch x seq_len; {predicted}. Fix: halve "
            f"train.micro_batch and raise train.accum to keep the global batch, or turn on train.recompute")


def loss_scale_trace(finite, scale: float, factor: int, window: int) -> list[float]:
    """The loss scale before each step of a finite/overflow sequence, by the rule of MindSpore 2.9's
    `amp.DynamicLossScaler.adjust`: an overflow divides the scale by `factor` (floor 1) and resets the counter;
    the `window`-th finite step in a row multiplies it by `factor`. Pure Python, so long sequences cost nothing
    (one `adjust` call is a few PyNative kernels); notebook 08 checks it against MindSpore's own class."""
    out, counter = [], 0
    for ok in finite:
        out.append(scale)
        if ok:
            if counter == window - 1:
                scale = scale * factor if math.isfinite(scale * factor) else scale
            counter = (counter + 1) % window
        else:
            scale, counter = max(1.0, scale / factor), 0
    return out


def halve_until_fits(probe, start: int, minimum: int = 1) -> list[dict]:
    """The seed's recipe: try `start`, halve on an out-of-memory death until a micro-batch fits. `probe(mb)`
    returns a `train_capped`-style dict. Any death other than out-of-memory, and an out-of-memory death before
    any step ran (compiling the graph, building the model), stops the search: halving cannot fix those."""
    if start < minimum:
        raise LabkitError(f"start micro-batch {start} is below the minimum {minimum}")
    tried, mb = [], start
    while mb >= minimum:
        r = probe(mb)
        tried.append(r)
        if r["fits"] or r["death"]["out_of_memory"] is False or r.get("phase", {}).get("phase") in ("compile", "setup"):
            break
        mb //= 2
    return tried
