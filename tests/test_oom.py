"""An out-of-memory kill is named wherever it happens.

- From recorded counters, no cgroup needed: a SIGKILL is out of memory only when the memory cgroup the process was in
  counted an OOM kill since the process was first seen (an older one in the same group is not blamed) or the kernel
  log names its pid; the limit is the lowest one on the group or an ancestor; the SIGKILL of a fault drill never
  is. The launcher's sentence then carries the knobs with the planner's figures.
- For real, where the machine allows a memory cgroup (root, cgroup v1 or a writable v2): `labkit launch --workers 1`
  and `labkit train` (watched by its parent process) in a cgroup too small for micro-batch 96 are killed by the
  kernel at step 0; each report says so, with the limit and the knobs.
  Only the classification is asserted, never when the kill came.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from labkit.config import load_run_config
from labkit.launch import launcher
from labkit.launch import supervisor as sv
from labkit.training import monitor as M
from labkit.training import oom as O

pytestmark = pytest.mark.slow  # `make check` leaves this file out (see pyproject.toml's markers)

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


@pytest.fixture
def fake_cgroups(tmp_path, monkeypatch):
    """cgroup v1 and v2 trees in tmp_path; every process is in /job of both (as /proc/<pid>/cgroup would say)."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for root in (v1, v2):
        (root / "job").mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (v1 / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # unlimited, as v1 writes it
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "memory.max").write_text(str(1024 * MB))  # the ancestor's limit applies to the group below
    monkeypatch.setattr(O, "CGROUP_V1", v1)
    monkeypatch.setattr(O, "CGROUP_V2", v2)
    monkeypatch.setattr(O, "group_of", lambda controller, pid="self": "/job")
    monkeypatch.setattr(O, "kernel_oom_line", lambda pid, since=0.0: None)
    return SimpleNamespace(v1=v1 / "job", v2=v2 / "job", root_v1=v1)


def v1_counters(group: Path, oom_kill: int, failcnt: int, limit_mb: int = 1536):
    group.joinpath("memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    group.joinpath("memory.failcnt").write_text(f"{failcnt}\n")
    group.joinpath("memory.limit_in_bytes").write_text(str(limit_mb * MB))


def v2_counters(group: Path, oom_kill: int, high: int = 0):
    group.joinpath("memory.events").write_text(f"low 0\nhigh {high}\nmax 7\noom 1\noom_kill {oom_kill}\n")
    group.joinpath("memory.max").write_text("max\n")


def test_a_sigkill_is_out_of_memory_only_when_the_cgroup_counted_a_kill_since_the_process_was_seen(fake_cgroups):
    v1_counters(fake_cgroups.v1, oom_kill=0, failcnt=0)
    watch = O.memory_watch(12345)
    assert (watch["method"], watch["group"]) == ("cgroup-v1", fake_cgroups.v1)
    v1_counters(fake_cgroups.v1, oom_kill=1, failcnt=150)
    death = O.oom_evidence(watch, -signal.SIGKILL)
    assert death["out_of_memory"] is True and "OOM killer" in death["how"], death
    assert "1 OOM kill(s) at its 1536 MB limit, 150 failed charges" in death["evidence"] and death["limit_mb"] == 1536
    assert O.oom_evidence(watch, 1)["out_of_memory"] is False  # counters alone do not make an exit 1 an OOM

    old = O.memory_watch(12345)  # the group already counted that kill: a later SIGKILL is not blamed on it
    other = O.oom_evidence(old, -signal.SIGKILL)
    assert other["out_of_memory"] is None and other["how"] == "SIGKILL with no cgroup record"


def test_cgroup_v2_counts_and_an_ancestors_limit(fake_cgroups, monkeypatch):
    (fake_cgroups.root_v1 / "memory.oom_control").unlink()  # no v1 memory controller: the unified hierarchy
    v2_counters(fake_cgroups.v2, oom_kill=2)
    watch = O.memory_watch(12345)
    assert watch["method"] == "cgroup-v2" and watch["before"]["oom_kills"] == 2
    v2_counters(fake_cgroups.v2, oom_kill=3)
    death = O.oom_evidence(watch, -signal.SIGKILL)
    assert death["out_of_memory"] is True and "memory cgroup /job: 1 OOM kill(s) at its 1024 MB limit" in death[
        "evidence"]


def test_the_kernel_log_alone_names_an_oom_kill_and_the_limit_is_then_the_machines(fake_cgroups, monkeypatch):
    line = "Out of memory: Killed process 12345 (python) total-vm:5031140kB, anon-rss:1510128kB"
    monkeypatch.setattr(O, "kernel_oom_line", lambda pid, since=0.0: line if pid == 12345 else None)
    death = O.oom_evidence({"pid": 12345, "since": 0.0, "method": None, "group": None, "before": {}}, -9)
    assert death["out_of_memory"] is True and line in death["evidence"]
    assert death["limit_mb"] == O.host_memory_mb()


def test_the_knobs_carry_the_planners_figures():
    cfg = load_run_config("configs/tiny_cpu.yaml", ["data.seq_len=512", "train.micro_batch=96"])
    text = O.memory_knobs(cfg, 1536)
    need = O.planner_need_mb(cfg)["total"]
    assert f"the planner counts {need:.0f} MB per worker at micro-batch 96 and seq_len 512" in text
    fits = max(m for m in range(1, 96) if O.planner_need_mb(cfg, m)["total"] <= 1536)
    assert f"--micro-batch {fits} or less" in text and O.planner_need_mb(cfg, fits + 1)["total"] > 1536
    assert "--set train.recompute=all" in text and "--set data.seq_len=256" in text and "1536 MB limit" in text
    assert "halve --micro-batch until it fits" in O.memory_knobs(cfg, 10**6)  # the count fits: MindSpore's share


def _sleeper(tmp_path, drill_rank=None) -> sv.Supervisor:
    """A stand-in single worker (a sleeping Python) watched by a Supervisor; `drill_rank`: a fault drill's rank."""
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return sv.Supervisor(root, single=True, msrun_log=tmp_path / "logs" / "msrun.log", drill_rank=drill_rank)


def _killed(sup: sv.Supervisor) -> int:
    os.kill(sup.root.pid, signal.SIGKILL)
    return sup.root.wait(timeout=30)


def test_the_launcher_names_an_oom_kill_and_never_a_fault_drill(fake_cgroups, tmp_path):
    v1_counters(fake_cgroups.v1, oom_kill=4, failcnt=10)  # an older OOM kill in the same group
    pl = SimpleNamespace(cfg=load_run_config("configs/tiny_cpu.yaml", ["train.micro_batch=96", "train.steps=3"]))
    sup = _sleeper(tmp_path)
    assert sup.memory[0]["before"]["oom_kills"] == 4  # recorded while the rank lived
    code = _killed(sup)
    v1_counters(fake_cgroups.v1, oom_kill=5, failcnt=160)
    reason = launcher.failure_reason(pl, sup, sv.Outcome(sv.FAILED, rank=0, code=code), 0)
    assert reason.startswith(f"rank 0 (pid {sup.root.pid}) was killed by signal SIGKILL (exit -9) after 0 of 3 steps: "
                             f"out of memory, killed by the kernel's OOM killer"), reason
    assert "at its 1536 MB limit" in reason and "--micro-batch" in reason and "train.recompute=all" in reason

    drill = _sleeper(tmp_path, drill_rank=0)  # the fault drill: the rank ends itself and says so in its log
    (tmp_path / "logs" / "worker_0.log").write_text("fault drill: rank 0 ends itself with SIGKILL after step 1\n")
    code = _killed(drill)
    v1_counters(fake_cgroups.v1, oom_kill=7, failcnt=180)
    assert drill.memory_death(0, code) is None
    plain = launcher.failure_reason(pl, drill, sv.Outcome(sv.FAILED, rank=0, code=code), 1)
    assert plain.endswith("after 1 of 3 steps") and "memory" not in plain


def test_labkit_train_is_watched_only_from_a_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "labkit" / "__main__.py"), "train", "--steps", "1"])
    for key in ("MS_ROLE", "RANK_ID", "MS_NODE_ID"):
        monkeypatch.delenv(key, raising=False)
    assert O._command_line_train()
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")  # a worker msrun started: the launcher names its death
    assert not O._command_line_train()
    monkeypatch.delenv("MS_ROLE")
    monkeypatch.setattr(sys, "argv", ["/x/ipykernel_launcher.py", "-f", "k.json"])  # main([...]) in a notebook
    assert not O._command_line_train()


CAPPED_RUN = ["--steps", "3", "--micro-batch", "96", "--set", "train.save_every=0", "--set", "train.peak_tflops=1"]


def _capped(tmp_path, *argv):
    """`python -m labkit ARGV` with everything it starts in a 700 MB memory cgroup (made and removed by
    monitor.run_capped, notebook 08a's cap): micro-batch 96 needs several GB, so the kernel kills the worker in step 0
    (while it compiles or runs it: whenever it happens, only the classification is asserted)."""
    if not sys.platform.startswith("linux") or M.cap_method() == "rlimit":
        pytest.skip("no memory cgroup can be made here: needs root with cgroup v1's memory controller, or a "
                    "writable cgroup v2 group with the memory controller delegated")
    env = {**os.environ, "GLOG_v": "3", "TQDM_DISABLE": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    r = M.run_capped([sys.executable, "-m", "labkit", *argv, "--output", str(tmp_path / "run"), *CAPPED_RUN], 700,
                     env=env, timeout=600)
    assert r["oom_kills"] >= 1, (r["returncode"], r["stdout"], r["stderr"][-3000:])
    return r


def _knobs_said(text: str) -> None:
    assert "the planner counts" in text and "micro-batch 96" in text and "700 MB limit" in text, text
    assert "--micro-batch" in text and "--set train.recompute=all" in text and "--set data.seq_len=64" in text, text


def test_a_launch_killed_for_memory_says_so(tmp_path):
    r = _capped(tmp_path, "launch", "--workers", "1")
    report = r["stdout"]
    assert r["returncode"] == 1, (report, r["stderr"][-3000:])
    first = report.splitlines()[0]
    assert first.startswith("FAILED: rank 0 (pid ") and "was killed by signal SIGKILL (exit -9) after 0 of 3" in first
    assert "out of memory, killed by the kernel's OOM killer" in first and "at its 700 MB limit" in first, report
    _knobs_said(report.splitlines()[1])


def test_labkit_train_killed_for_memory_says_so(tmp_path):
    """`labkit train` typed on a command line: its parent process names the kill, then ends the same way."""
    r = _capped(tmp_path, "train")
    assert r["returncode"] == -signal.SIGKILL, r["stderr"][-3000:]
    said = [line for line in r["stderr"].splitlines() if "labkit train: error: out of memory" in line]
    assert said and "OOM killer" in said[0] and "700 MB limit" in said[0], r["stderr"][-3000:]
    _knobs_said(r["stderr"])
