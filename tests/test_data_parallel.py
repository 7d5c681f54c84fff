"""Data parallel for real (msrun, 2 CPU workers): equivalence with one worker, a killed worker, interrupts.

Each launch costs an msrun start and a graph compile (~15-30 s on 2 quiet cores), so the runs are shared."""
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

from labkit import launch

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = ["train.save_every=2"]
LOSS_TOL = 1e-4  # float32 summation order differs (two half-batch means averaged vs one mean): ~1e-6 seen
WEIGHT_TOL = 1e-4  # after 4 AdamW steps; the weights themselves move by ~1e-3 per step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp")
    one = launch.launch("configs/tiny_cpu.yaml", workers=1, output=base / "one", steps=STEPS, overrides=COMMON,
                        progress=False)
    two = launch.launch("configs/dp2_cpu.yaml", workers=2, output=base / "two", steps=STEPS, overrides=COMMON,
                        progress=False)
    assert one.ok, one.report()
    assert two.ok, two.report()
    return base, one, two


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_two_workers_match_one_worker_with_twice_the_batch(runs):
    _, one, two = runs
    assert (one.summary["global_batch"], two.summary["global_batch"]) == (8, 8)
    assert (one.summary["world_size"], two.summary["world_size"]) == (1, 2)
    cmp = launch.compare_runs(one.output, two.output)
    assert cmp["steps"] == list(range(1, STEPS + 1))
    assert cmp["max_loss_diff"] < LOSS_TOL, cmp
    assert cmp["max_weight_diff"] < WEIGHT_TOL, cmp
    # the tolerance is meaningful: two training steps move the weights far more than the DP difference
    moved = launch.compare_runs(f"{one.output}/checkpoints/step_000002", f"{one.output}/checkpoints/step_000004")
    assert moved["max_weight_diff"] > 20 * max(cmp["max_weight_diff"], 1e-7), (moved, cmp)
    assert {p.name for p in Path(two.logs).glob("worker_*.log")} == {"worker_0.log", "worker_1.log"}
    assert not _alive(one.pids + two.pids)


def test_killed_worker_is_reported_and_the_run_resumes_exactly(runs):
    base, _, two = runs
    out = base / "killed"
    started = time.perf_counter()
    res = launch.launch("configs/dp2_cpu.yaml", workers=2, output=out, steps=STEPS, overrides=COMMON,
                        kill_rank=1, kill_after_step=3, progress=False)
    assert not res.ok and res.failed_rank == 1 and res.returncode == -9, res.report()
    assert "rank 1" in res.reason and "SIGKILL" in res.reason
    assert res.stop_seconds < 30, res.stop_seconds  # death -> every process ended
    assert time.perf_counter() - started < 600
    assert not _alive(res.pids), "no process of the job may survive"
    assert res.checkpoint and res.checkpoint.endswith("step_000002")
    assert json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())["step"] == 2
    assert not list((out / "checkpoints").glob(".tmp-*"))

    again = launch.launch("configs/dp2_cpu.yaml", workers=2, output=out, steps=STEPS, resume=True, progress=False)
    assert again.ok and again.steps_done == STEPS, again.report()
    cmp = launch.compare_runs(two.output, out)
    assert cmp["steps"] == list(range(1, STEPS + 1))
    assert cmp["max_loss_diff"] < 1e-6 and cmp["max_weight_diff"] < 1e-6, cmp


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@contextlib.contextmanager
def running_launcher(tmp_path, name):
    """`labkit launch` in a subprocess, yielded once msrun has started both workers; everything is ended after."""
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "launch", "--config", "configs/dp2_cpu.yaml",
                             "--output", str(tmp_path / name), "--steps", "50", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, "GLOG_v": "3"})
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
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
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
    res = launch.launch("configs/tiny_cpu.yaml", workers=1, output=tmp_path / "slow", steps=50, timeout=3,
                        progress=False)
    assert not res.ok and res.reason.startswith("timed out after 3 s"), res.report()
    assert res.returncode != 0 and not _alive(res.pids)
