"""Who killed a process? An out-of-memory kill named wherever it happens, with the knobs to turn.

A process's memory cgroup is read while it lives and again at its death (`memory_watch`, `oom_evidence`; the launcher
asks it about every rank), and the report gives the limit and the planner's figures (`memory_knobs`). `labkit train`
typed on a command line is watched by a parent process that does the same (`train_watched`). The caps notebook 08a
puts on its own runs, and `classify_death`, are in labkit.training.monitor."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

from labkit.errors import LabkitFailure
from labkit.layout import Recompute
from labkit.output import run_error
from labkit.parallel.memory import Numerics, memory_breakdown
from labkit.training.metrics import read_metrics
from labkit.training.monitor import CGROUP_V1, CGROUP_V2, classify_death, group_of, group_stats

# ------------------------------------------------------------------------------------------- who killed a process
# A process killed with SIGKILL cannot say why. The kernel's OOM killer counts each kill in the memory controller of
# the victim's cgroup (v2: `oom_kill` in memory.events, also in every ancestor; v1: `oom_kill` in memory.oom_control,
# beside memory.failcnt) and logs "Killed process <pid>" in the kernel log. `memory_watch` records a live process's
# group and its counters; `oom_evidence` reads them again at its death, so only a kill since then is blamed (an older
# OOM kill in the same group is not), and asks the kernel log about the pid where it is readable (root).


def memory_group(pid: int | str = "self") -> tuple[str, Path] | None:
    """('cgroup-v1' or 'cgroup-v2', folder) of the memory cgroup a process is in; None without one (or when gone)."""
    v1 = group_of("memory", pid)
    if v1 is not None and (CGROUP_V1 / "memory.oom_control").exists():
        group = CGROUP_V1 / v1.lstrip("/")
        return ("cgroup-v1", group) if group.is_dir() else None
    v2 = group_of("", pid)
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
            "before": group_stats(method, group)}


def oom_evidence(watch: dict | None, returncode: int, stderr: str = "") -> dict:
    """`classify_death` of a process seen by `memory_watch`: the rise of its cgroup's OOM-kill and failed-charge
    counters since then, the kernel log's record of its pid (for SIGKILL), the last lines it wrote. Adds `limit_mb`,
    the memory it ran under: its cgroup's limit, else the machine's RAM."""
    watch = watch or {}
    method, group = watch.get("method"), watch.get("group")
    after, before = group_stats(method, group), watch.get("before") or {}
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
    given), MB by part: `labkit.parallel.memory` as notebook 08a quotes it on CPU (fp32, no flash attention, unfused
    norm; `last:K` and the like weigh the planner's none and full by the share of layers recomputed). Not counted:
    MindSpore's own memory    (libraries, graph compilation, allocator pools)."""
    import dataclasses


    layout = dataclasses.replace(cfg.layout(), micro_batch=micro_batch or cfg.train.micro_batch,
                                 recompute=Recompute.parse(recompute) if recompute else cfg.train.recompute)
    parts = memory_breakdown(cfg.model_config(), layout, seq_len=seq_len or cfg.data.seq_len,
                             numerics=Numerics(amp_level="O0", flash_attention=False, fused_norm=False))
    return {k: round(v * 1024, 1) for k, v in parts.items() if k not in ("stage", "params")}


def memory_knobs(cfg, limit_mb: float | None) -> str:
    """What to turn after a run of `cfg` ran out of `limit_mb` MB (micro-batch, recompute, sequence length), each with
    the planner's figure. Command-line flags of `labkit train` and `labkit launch` alike."""
    t, seq = cfg.train, cfg.data.seq_len
    need = planner_need_mb(cfg)
    state = need["weights"] + need["gradients"] + need["optimizer"]
    limit = f" against the {limit_mb:.0f} MB limit" if limit_mb else ""
    knobs = [_micro_batch_knob(cfg, need["total"], limit_mb)]
    if t.recompute != Recompute("full"):
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
# and ends as the child ended: its exit code, or by the same signal, so whoever reads the exit status (notebook 08a's
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
