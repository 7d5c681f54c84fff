"""Memory troubleshooting: run a command under a memory cap, tell an out-of-memory death from other deaths (and say
what the planner predicted), search for the largest micro-batch that fits, and watch process RSS step by step for
a slow leak. Naming an OOM kill where no cap of ours is involved (the launcher, `labkit train`): labkit.training.oom.

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

from labkit.config import load_run_config
from labkit.errors import LabkitError
from labkit.training.metrics import read_metrics

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


def group_of(controller: str, pid: int | str = "self") -> str | None:
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
    own = group_of("memory")
    for parent in ([CGROUP_V1 / own.lstrip("/")] if own else []) + [CGROUP_V1]:
        if parent.is_dir() and os.access(parent, os.W_OK):
            return parent
    return None


def _v2_parent() -> Path | None:
    own = group_of("")
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


def group_stats(method: str, group: Path | None) -> dict:
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
        stats = group_stats(method, group)
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
    planner's, `labkit.training.oom.planner_need_mb`); the report quotes it."""
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
    (one `adjust` call is a few PyNative kernels); notebook 08a checks it against MindSpore's own class."""
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
