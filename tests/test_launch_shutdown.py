"""The launcher (labkit.launch) with data parallel for real (msrun, 2 CPU workers): every process ends on an
interrupt, a dead launcher, a timeout.

The equivalences (2 workers x b == 1 worker x 2b, killed + resumed == uninterrupted) are asserted by
notebooks/05_data_parallel.ipynb, which `make test` executes under nbval in the same session; running them here
as well cost ~3 minutes of CI for the same launches."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from labkit.launch import launcher as launch

pytestmark = pytest.mark.slow

def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# steps no machine trains through while a test interrupts or times out the job: what is checked (every process ended)
# must not depend on whether the run would have finished first
NEVER_ENDS = 1_000_000


def _as_a_shell_would():
    """In the launcher's process before it starts: SIGINT handled by default and not blocked, as a terminal starts a
    command. A child inherits ignored signals and the signal mask of the thread that started it, and this test's
    process is a pytest-xdist worker whose state earlier tests (and the libraries they load) may have changed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _signal_state(pid: int) -> str:
    try:
        return " ".join(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return str(e)


@contextlib.contextmanager
def running_launcher(tmp_path, name):
    """`labkit launch` in a subprocess, yielded once msrun has started both workers; everything is ended after."""
    err = open(tmp_path / f"{name}.stderr", "w")  # with PYTHONFAULTHANDLER, a SIGABRT writes every thread's stack
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "launch", "--config", "configs/dp2_cpu.yaml",
                             "--output", str(tmp_path / name), "--steps", str(NEVER_ENDS), "--json"],
                            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                            env={**os.environ, "GLOG_v": "3", "PYTHONFAULTHANDLER": "1"}, preexec_fn=_as_a_shell_would)
    err.close()
    me, seen = psutil.Process(proc.pid), set()
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            kids = me.children(recursive=True)
            seen |= {k.pid for k in kids}
            # msrun, its scheduler and two workers all carry `labkit.launch train` on their command line
            if sum("labkit.launch" in c and "train" in c for c in map(_cmdline, kids)) >= 4:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the workers did not start")
        yield proc, seen
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(seen):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_interrupt_ends_every_process(tmp_path):
    """What the notebook's interrupt button does: SIGINT to the launcher."""
    with running_launcher(tmp_path, "interrupted") as (proc, pids):
        before = _signal_state(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)  # a guard against a hang: the launcher ends the job in ~2 s
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # where it hangs: the stacks faulthandler writes to its stderr
            after = _signal_state(proc.pid)
            proc.wait(30)
            pytest.fail(f"the launcher did not end after SIGINT; its signal state before it: {before}; "
                        f"60 s after: {after}; its stderr:\n"
                        + (tmp_path / "interrupted.stderr").read_text(errors="replace")[-6000:])
        assert proc.returncode == 130
        assert json.loads(out) == {"ok": False, "error": "interrupted"}
        assert not _alive(pids)


def test_launcher_death_ends_every_process(tmp_path):
    """A kernel killed outright cannot clean up: the guard process does."""
    with running_launcher(tmp_path, "orphaned") as (proc, pids):
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        while _alive(pids) and time.time() < deadline:
            time.sleep(0.5)
        assert not _alive(pids)


def test_timeout_ends_a_single_worker_run(tmp_path):
    res = launch.launch(launch.LaunchSpec("configs/tiny_cpu.yaml", workers=1, output=tmp_path / "slow",
                                          steps=NEVER_ENDS), timeout=3, progress=False)
    assert not res.ok and res.reason.startswith("timed out after 3 s"), res.report()
    assert res.returncode != 0 and not _alive(res.pids)
