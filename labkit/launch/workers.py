"""Run a Python script (or module) on N msrun workers on this machine (CPU) and wait for it, supervised: on a
timeout or a failed worker msrun's process group and every worker's session are ended, and the error names the
rank and shows the end of its log. The course's worker programs (the tensor-parallel demo, the parallel layouts)
start here; `labkit launch` is the path for training runs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError, LabkitFailure
from labkit.launch.supervisor import FINISHED, Supervisor, log_tail, supervise
from labkit.launch.validate import CLUSTER_ENV, free_port, python_on_path
from labkit.parallel.msrun import Cluster, msrun_args, msrun_head
from labkit.runtime import process_env


@dataclass
class WorkersRun:
    command: str  # the msrun line, as a user would type it
    log_dir: Path
    seconds: float
    pids: list


def job_env(logs: Path, device_target: str) -> dict:
    """The workers' environment: no inherited cluster variables, the process settings of the run's device target
    (labkit.runtime; what the caller set wins), the caller's python first on PATH."""
    env = {**process_env(device_target), **{k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}}
    env.setdefault("MS_OM_PATH", str(logs))  # a failed graph compile writes rank_N/om/analyze_fail.ir here, not ./
    return python_on_path(env, logs / ".bin")


def run_workers(task: list[str], workers: int, cwd: Path, *, what: str, timeout: float = 300,
                expect=None, env: dict | None = None) -> WorkersRun:
    """`msrun --worker_num=workers ... TASK` with logs in cwd/logs (worker_<rank>.log: each worker's output).
    `expect()`: True once every worker reported (checked after a clean exit: a run whose workers all exited 0
    without reporting failed too). `env`: variables added to the workers' environment."""
    if workers < 1:
        raise LabkitError(f"{what}: needs at least 1 worker, got {workers}")
    if not (Path(sys.executable).parent / "msrun").exists():
        raise LabkitError(f"msrun not found next to {sys.executable}", "install MindSpore into this environment")
    logs = Path(cwd) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**job_env(logs, "CPU"), **(env or {}), "GLOG_v": "3"}
    cmd = msrun_args(Cluster(workers, workers, master_port=free_port()), log_dir=logs, head=msrun_head()) + list(task)
    t0 = time.time()
    with open(logs / "msrun.log", "w", encoding="utf-8") as sink:
        root = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    sup = Supervisor(root, single=False, workers=workers, msrun_log=logs / "msrun.log", timeout=timeout)
    try:
        outcome = supervise(sup)
    finally:
        survivors = sup.stop()
    if outcome.state != FINISHED or (expect is not None and not expect()):
        rank = outcome.rank if outcome.rank is not None else 0
        why = (f"did not finish in {timeout:g} s" if outcome.state == "timeout" else
               f"failed (msrun exit {root.returncode}; rank {rank}'s log below)" if outcome.state != FINISHED else
               "ended without every worker's result")
        ended = "every process was ended" if not survivors else f"processes {survivors} could not be ended"
        raise LabkitFailure(f"{what} {why}; {ended}",
                            f"see {logs}; last lines of rank {rank}'s log:\n{log_tail(logs / f'worker_{rank}.log')}")
    return WorkersRun(" ".join(["msrun", *cmd[1:]]), logs, round(time.time() - t0, 1), sup.pids)
