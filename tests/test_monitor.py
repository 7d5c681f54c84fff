"""labkit.training.monitor: a real memory cap, an out-of-memory death told from other deaths, the leak slope."""
import mmap
import sys

import numpy as np
import pytest

from labkit.training import monitor as M

ALLOC = "import sys; x = bytearray(int(sys.argv[1]) * 2**20); print('allocated')"


def py(code, *args):
    return [sys.executable, "-c", code, *map(str, args)]


def test_cap_kills_an_allocation_above_it_and_spares_one_below():
    small = M.run_capped(py(ALLOC, 50), 300)
    assert small["returncode"] == 0 and "allocated" in small["stdout"]
    assert M.classify_death(small)["out_of_memory"] is False
    big = M.run_capped(py(ALLOC, 600), 300)
    assert big["returncode"] != 0
    death = M.classify_death(big)
    assert death["out_of_memory"] is True, (big, death)
    if big["method"].startswith("cgroup"):
        assert big["returncode"] == -9 and big["oom_kills"] >= 1 and "OOM killer" in death["how"]
        assert big["peak_mb"] <= 300 + 1  # the cgroup never let it past the limit


def test_rlimit_fallback_gives_a_memory_error():
    # the address-space baseline of a bare Python is ~20-30 MB, far under the 200 MB allowance given here
    r = M.run_capped(py(ALLOC, 600), 100, method="rlimit", address_overhead_mb=200)
    death = M.classify_death(r)
    assert r["returncode"] == 1 and death == {**death, "out_of_memory": True, "how": "Python MemoryError"}


def test_other_deaths_are_not_called_out_of_memory():
    r = M.run_capped(py("raise ValueError('bad shape [3, 4]')"), 300)
    death = M.classify_death(r)
    assert death["out_of_memory"] is False and "ValueError" in death["evidence"]
    assert "out of memory" not in M.oom_report(death, 8, 300)
    fake = {"returncode": 1, "stderr": "RuntimeError: Allocate memory failed, size 4096 MB\n", "limit_mb": 1}
    assert M.classify_death(fake)["how"] == "allocator failure"


def test_leak_monitor_flags_memory_kept_every_step_and_not_a_flat_loop():
    kept = []
    for leak_mb, expect in ((0, False), (4, True)):
        mon = M.LeakMonitor(skip=2, threshold_mb_per_step=1.0)
        for step in range(1, 21):
            scratch = np.ones(2**20)  # 8 MB allocated and freed every step, as a healthy loop does
            if leak_mb:  # fresh pages straight from the kernel, touched: resident whatever the allocator already
                # holds (a process that ran other tests first can serve np.ones from freed, still-resident heap)
                page = np.frombuffer(mmap.mmap(-1, leak_mb * 2**20), np.uint8)
                page[:] = 1
                kept.append(page)
            mon({"step": step})
            del scratch
        rep = mon.report()
        assert rep["flagged"] is expect, rep
        if expect:  # the slope is the leak rate, measured: 4 MB/step within page and allocator noise
            assert 3.0 < rep["slope_mb_per_step"] < 5.0
    assert M.LeakMonitor().report()["flagged"] is False


def test_leak_monitor_leaves_out_one_off_jumps_after_evaluations_and_saves(monkeypatch):
    """RSS as the tiny model's 40-step run measured it (flat, +11, +23 and +1.3 MB right after the saves at steps
    10, 20, 30 and the evaluation at 20): a 1.25 MB/step 'leak' unless those steps are marked; a real 3 MB/step leak
    with the same jumps keeps its slope when they are marked."""
    def run(leak: float, mark: bool) -> dict:
        mon, level = M.LeakMonitor(), [1195.0]
        monkeypatch.setattr(M, "rss_mb", lambda: level[0])
        for step in range(1, 41):
            mon({"step": step})
            level[0] += leak + {10: 11.0, 20: 23.1, 30: 1.3}.get(step, 0.0)
            if mark and step % 10 == 0:
                mon.one_off(step)
        return mon.report()

    unmarked, marked = run(0.0, False), run(0.0, True)
    assert unmarked["flagged"] and unmarked["slope_mb_per_step"] > 1.0, unmarked
    assert not marked["flagged"] and marked["slope_mb_per_step"] == 0.0, marked
    assert "one-off changes after steps 10, 20, 30 left out" in marked["message"]
    leak = run(3.0, True)
    assert leak["flagged"] and leak["slope_mb_per_step"] == 3.0, leak


def test_halving_stops_at_the_first_fit_and_on_a_non_memory_death():
    def probe(limit, other_death_at=None):
        def run(mb):
            if mb == other_death_at:
                return {"micro_batch": mb, "fits": False, "death": {"out_of_memory": False}}
            return {"micro_batch": mb, "fits": mb <= limit, "death": {"out_of_memory": mb > limit}}
        return run

    assert [r["micro_batch"] for r in M.halve_until_fits(probe(8), 64)] == [64, 32, 16, 8]
    assert [r["micro_batch"] for r in M.halve_until_fits(probe(8, other_death_at=32), 64)] == [64, 32]
    assert not M.halve_until_fits(probe(0), 4)[-1]["fits"]


def test_planner_prediction_grows_with_the_micro_batch_in_activations_only():
    from labkit.config import load_run_config
    from labkit.training.oom import planner_need_mb

    cfg = load_run_config("configs/tiny_cpu.yaml")
    a, b = planner_need_mb(cfg, 8), planner_need_mb(cfg, 16)
    assert b["weights"] == a["weights"] and b["optimizer"] == a["optimizer"]
    assert b["activations"] == pytest.approx(2 * a["activations"], rel=0.01)


def test_loss_scale_trace_matches_mindspores_dynamic_loss_scaler():
    import mindspore as ms

    pattern = [True] * 5 + [False] + [True] * 9 + [False, False] + [True] * 7
    for window in (1, 3, 50):
        scaler, real = ms.amp.DynamicLossScaler(1024.0, 2, window), []
        for ok in pattern:
            real.append(float(scaler.scale_value.asnumpy()))
            scaler.adjust(ms.Tensor(ok))
        assert M.loss_scale_trace(pattern, 1024.0, 2, window) == real, window


JIT = """
import sys
import mindspore as ms
from mindspore import ops

@ms.jit
def step(x):
    return ops.relu(x) * 2

step(ms.Tensor([1.0]))
print("ran", flush=True)
sys.exit(3)
"""


@pytest.mark.slow
def test_death_phase_reads_mindspores_compile_log(tmp_path):
    script = tmp_path / "jit_then_die.py"  # MindSpore parses a jit function's source, so it must be a file
    script.write_text(JIT)
    import os
    import subprocess

    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GLOG_v": "3", **M.COMPILE_LOG_ENV})
    assert p.returncode == 3 and "ran" in p.stdout
    events = M.compile_events(p.stderr)
    assert [(k, n) for _, k, n in events] == [("start", "step"), ("end", "step")]
    assert 0 <= events[1][0] - events[0][0] < 120  # wall-clock timestamps of one process, in order
    timeline = [(events[0][0] - 1, 100.0), (events[0][0] + 1e-3, 150.0), (events[1][0] + 1e-3, 400.0)]
    after = M.death_phase(p.stderr, 0, timeline)
    assert after["phase"] == "step" and after["step"] == 1
    assert after["compiles"]["step"] == {"start_mb": 100, "end_mb": 150}
    # the same log cut where compilation began: a process killed there died compiling, and halving cannot help
    cut = p.stderr[:p.stderr.index("End compiling")]
    during = M.death_phase(cut, 0)
    assert during["phase"] == "compile" and during["graph"] == "step"
    assert "halving train.micro_batch will not help" in M.oom_report(
        {"out_of_memory": True, "how": "killed", "evidence": "cgroup"}, 8, 500, None, during)
    assert M.death_phase("no MindSpore here", 0)["phase"] == "setup"
    assert M.death_phase("no MindSpore here", 4)["phase"] == "step"


def test_run_capped_samples_the_memory_it_charges():
    r = M.run_capped(py("import sys, time; x = bytearray(200 * 2**20); x[::4096] = b'1' * len(x[::4096]); "
                        "time.sleep(0.5)"), 400)
    if not r["method"].startswith("cgroup"):
        pytest.skip("no memory cgroup to sample here")
    peak = max(mb for _, mb in r["timeline"])
    assert 200 <= peak <= r["peak_mb"] + 1, (peak, r["peak_mb"])


def test_halving_stops_on_a_death_before_any_step():
    def run(mb):
        return {"micro_batch": mb, "fits": False, "death": {"out_of_memory": True}, "phase": {"phase": "compile"}}

    assert [r["micro_batch"] for r in M.halve_until_fits(run, 64)] == [64]
