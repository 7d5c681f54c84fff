"""The launcher's supervisor on fake jobs (plain Python children, no MindSpore): each look at a job returns what it
found, and stop() ends every process, also workers in their own sessions as msrun starts them."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from labkit.launch import supervisor as sv

# A stand-in for msrun: starts one child per argument in its own session (setsid, as msrun does) with the
# environment msrun gives its workers; prints msrun's line for a worker that failed, then waits like msrun does;
# exits 0 when every worker exited 0. "sleep" = a worker that never ends.
FAKE_MSRUN = r"""
import os, subprocess, sys, time
procs = []
for rank, what in enumerate(sys.argv[1:]):
    prog = "import time; time.sleep(120)" if what == "sleep" else f"import sys, time; time.sleep(1.0); sys.exit({what})"
    env = {**os.environ, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)}
    procs.append(subprocess.Popen([sys.executable, "-c", prog], env=env, start_new_session=True))
reported = set()
while True:
    for p in procs:
        if p.poll() not in (None, 0) and p.pid not in reported:
            print(f"Worker process {p.pid} exit with exception. Error code: {p.returncode}", flush=True)
            reported.add(p.pid)
    if all(p.poll() == 0 for p in procs):
        sys.exit(0)
    time.sleep(0.1)
"""


def fake_job(tmp_path, *ranks, timeout=None):
    log = tmp_path / "msrun.log"
    with open(log, "w") as sink:
        root = subprocess.Popen([sys.executable, "-c", FAKE_MSRUN, *ranks], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return sv.Supervisor(root, single=False, workers=len(ranks), msrun_log=log, timeout=timeout)


def until_done(sup, limit=30.0):
    deadline = time.perf_counter() + limit
    seen_ranks = set()
    while time.perf_counter() < deadline:
        out = sup.poll()
        seen_ranks |= set(sup.ranks)
        if out.done:
            return out, seen_ranks
        time.sleep(sv.POLL_S)
    pytest.fail("the job did not end")


def alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_all_workers_finish(tmp_path):
    sup = fake_job(tmp_path, "0", "0")
    assert sup.poll() == sv.Outcome(sv.RUNNING)
    out, ranks = until_done(sup)
    assert out.state == sv.FINISHED and ranks == {0, 1}
    assert sup.stop() == []


def test_a_failed_rank_is_named_and_every_session_is_ended(tmp_path):
    sup = fake_job(tmp_path, "sleep", "3")
    out, ranks = until_done(sup)
    assert (out.state, out.rank, out.code) == (sv.FAILED, 1, 3), out
    sleeper = sup.ranks[0].pid
    assert alive([sleeper]), "rank 0 runs in its own session: only stop() may end it"
    assert sup.stop() == [] and not alive(sup.pids)


def test_timeout(tmp_path):
    sup = fake_job(tmp_path, "sleep", "sleep", timeout=1.5)
    t0 = time.perf_counter()
    out, _ = until_done(sup)
    assert out.state == sv.TIMEOUT and out.reason == "timed out after 1.5 s"
    assert 1.5 <= time.perf_counter() - t0 < 1.5 + 2 * sv.POLL_S + 1.0  # one poll past the limit, plus start-up
    pids = sup.pids
    assert len(pids) == 3 and sup.stop() == [] and not alive(pids)


def test_single_worker_exit_code(tmp_path):
    root = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(4)"], start_new_session=True)
    sup = sv.Supervisor(root, single=True, first_rank=2)
    out, _ = until_done(sup)
    assert (out.state, out.rank, out.code) == (sv.FAILED, 2, 4)
    root = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    assert until_done(sv.Supervisor(root, single=True))[0].state == sv.FINISHED


def test_interrupt_ends_every_process_and_is_raised(tmp_path):
    sup = fake_job(tmp_path, "sleep", "sleep")
    looks = []

    def tick():
        looks.append(set(sup.ranks))
        if sup.ranks.keys() == {0, 1}:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sv.supervise(sup, tick)
    assert len(sup.pids) == 3 and not alive(sup.pids)


def test_what_the_scheduler_says_about_another_node_ends_the_job(tmp_path):
    """Node 0's scheduler log names a rank whose heartbeat stopped, or says the cluster never gathered: the job
    is failed at once (MindSpore's own processes would take half a minute more to exit)."""
    sup = fake_job(tmp_path, "sleep")
    until_ranks = time.perf_counter() + 20
    while not sup.ranks and time.perf_counter() < until_ranks:
        sup.poll()
        time.sleep(sv.POLL_S)
    assert sup.poll().state == sv.RUNNING
    (tmp_path / "scheduler.log").write_text(
        "[ERROR] DISTRIBUTED(1) [meta_server_node.cc:548] UpdateTopoState] The node: 1 is timed out. It may exit "
        "with exception, please check this node's log.\n")
    out = sup.poll()
    assert (out.state, out.rank) == (sv.FAILED, 1) and out.reason.startswith("node 1's rank 1 stopped answering")
    (tmp_path / "scheduler.log").write_text("RuntimeError: Failed to initialize distributed job cluster because\n")
    out = sup.poll()
    assert (out.state, out.reason) == (sv.FAILED, sv.CLUSTER_NOT_GATHERED)
    assert sup.stop() == [] and not alive(sup.pids)


INTERRUPTED = r"""
import os, signal, time
from labkit.launch.supervisor import interrupt_flag
before = signal.getsignal(signal.SIGINT)
with interrupt_flag() as flag:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the next bytecode: no KeyboardInterrupt here
    print("flag", flag.is_set())
print("restored", signal.getsignal(signal.SIGINT) is before)
"""


def test_an_interrupt_during_a_launch_sets_a_flag_and_the_handler_comes_back():
    """SIGINT while `interrupt_flag` is held is a flag the watch loop turns into KeyboardInterrupt, wherever the main
    thread was when it came. In a process of its own: signals are handled by a main thread, and a test runner's
    worker may run tests in another thread (where the flag is not installed and SIGINT would end the worker)."""
    p = subprocess.run([sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["flag", "True", "restored", "True"], p.stdout + p.stderr
