"""Faults: a damaged newest checkpoint, SIGKILL at random moments, and a full disk.

- `--resume` skips a damaged newest checkpoint (flipped byte, cut file, broken state.json), says which and why, and
  continues from the previous good one.
- The kill drills of bench/fault_drill.py, a few seeded points per command (the bench runs many): after each kill the
  output path holds a complete, verified output and nothing half-written looks complete.
- Disk full, on a small tmpfs mounted inside a private mount namespace (root + `unshare -m`; skipped otherwise):
  conversion, data build and a checkpoint save fail with one "no space left" error line and leave nothing; training
  stops the same way, and `--resume` works once space is freed.
The training drills run one decoder layer of the tiny model (SMALL_RUN): the same code paths at half the compile time.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from labkit.errors import LabkitError
from labkit.training import checkpoint

pytestmark = pytest.mark.slow  # `make check` leaves this file out (see pyproject.toml's markers)
ROOT = Path(__file__).resolve().parents[1]


# The training drills use one decoder layer and no GEMM probe: what they check (which checkpoint a resume takes, what a
# full disk leaves) does not depend on depth, and one layer compiles in about half the time of the tiny model's four.
SMALL_RUN = ("model.num_layers=1", "train.peak_tflops=1")
SMALL_SETS = [a for s in SMALL_RUN for a in ("--set", s)]  # the same, as `labkit train` arguments


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", "TQDM_DISABLE": "1"}


def _drill_module():
    spec = importlib.util.spec_from_file_location("fault_drill", ROOT / "bench" / "fault_drill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------ damaged newest checkpoint


def _params(seed: int):
    import mindspore as ms

    rng = np.random.default_rng(seed)
    return [(f"w{i}", ms.Parameter(ms.Tensor(rng.standard_normal((16, 8)).astype(np.float32)), name=f"w{i}"))
            for i in range(3)]


def _flip_byte(p: Path):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


DAMAGE = {
    "flipped byte in state.ckpt": lambda d: _flip_byte(d / "state.ckpt"),
    "state.ckpt cut short": lambda d: (d / "state.ckpt").write_bytes((d / "state.ckpt").read_bytes()[:100]),
    "state.json not JSON": lambda d: (d / "state.json").write_text('{"kind": "full", "step": '),
    "state.ckpt missing": lambda d: (d / "state.ckpt").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, damage):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, _params(step), {"note": step}, keep=3)
    DAMAGE[damage](tmp_path / "checkpoints" / "step_000003")
    said = []
    ck, params, meta = checkpoint.load_newest_good(tmp_path, said.append)
    assert ck.name == "step_000002" and meta["step"] == 2
    np.testing.assert_array_equal(params["w0"].asnumpy(), _params(2)[0][1].asnumpy())
    assert "step_000003" in said[0] and "falling back" in said[0], said
    assert "using" in said[-1] and "step_000002" in said[-1], said


def test_no_usable_checkpoint_lists_every_reason(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, _params(step), {}, keep=2)
        _flip_byte(tmp_path / "checkpoints" / f"step_{step:06d}" / "state.ckpt")
    with pytest.raises(LabkitError, match="no usable checkpoint.*step_000002.*damaged.*step_000001"):
        checkpoint.load_newest_good(tmp_path, lambda m: None)


def test_an_undamaged_checkpoint_is_used_silently(tmp_path):
    checkpoint.save(tmp_path, 1, _params(1), {}, keep=2)
    said = []
    assert checkpoint.load_newest_good(tmp_path, said.append)[0].name == "step_000001" and said == []
    rec = json.loads((tmp_path / "checkpoints" / "step_000001" / "state.json").read_text())
    assert rec["state_ckpt"]["bytes"] == (tmp_path / "checkpoints" / "step_000001" / "state.ckpt").stat().st_size


def test_train_resume_says_it_fell_back(tmp_path):
    """The real command: 2 steps with a checkpoint each (written by the trainer in this process), the newest
    damaged, then `labkit train --resume` in its own process continues from step 1."""
    from labkit.config import load_run_config
    from labkit.training.trainer import train

    out = tmp_path / "运行 目录"
    train(load_run_config("configs/tiny_cpu.yaml", [f"output_dir={out}", "train.save_every=1", "train.steps=2",
                                                    *SMALL_RUN]), log=lambda m: None)
    _flip_byte(out / "checkpoints" / "step_000002" / "state.ckpt")
    again = subprocess.run([sys.executable, "-m", "labkit", "train", "--output", str(out), "--set",
                            "train.save_every=1", *SMALL_SETS, "--steps", "2", "--resume"], capture_output=True,
                           text=True, env=_env(), timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step_000002 is unusable" in again.stderr and "falling back" in again.stderr
    assert "resumed from" in again.stderr and "step_000001 at step 1" in again.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    checkpoint.load_full(out / "checkpoints" / "step_000002")  # rewritten whole by the resumed run


# ------------------------------------------------------------------------------------------ kill drills


def test_a_fault_drill_must_fall_inside_the_run():
    from labkit.training.fault import Fault, check_fault

    assert check_fault(None, 3, 2, 0, 4) is None
    assert check_fault(1, 3, 2, 0, 4) == Fault(1, 3)
    with pytest.raises(LabkitError, match="--kill-rank 2: the job has ranks 0..1"):
        check_fault(2, 3, 2, 0, 4)
    with pytest.raises(LabkitError, match="--kill-after-step 4 is not inside the run") as e:
        check_fault(1, 4, 2, 0, 4)  # after the last step the run has ended: no longer a mid-run kill
    assert "between 1 and 3" in e.value.fix
    with pytest.raises(LabkitError, match="--kill-after-step 2 is not inside the run"):
        check_fault(0, 2, 1, 2, 4)  # a resumed run starts after step 2


def test_train_killed_by_its_own_drill_leaves_the_checkpoints_before_the_kill(tmp_path):
    """`labkit train --kill-rank 0 --kill-after-step 3`: the process ends itself with SIGKILL right after step 3,
    after that step's metrics, so what it leaves is fixed by the step, never by how fast anything ran."""
    out = tmp_path / "killed"
    p = subprocess.run([sys.executable, "-m", "labkit", "train", "--output", str(out), *SMALL_SETS, "--steps", "5",
                        "--set", "train.save_every=2", "--set", "train.eval_every=0", "--kill-rank", "0",
                        "--kill-after-step", "3"], capture_output=True, text=True, env=_env(), timeout=900)
    assert p.returncode == -9, p.stderr[-2000:]
    assert "fault drill: rank 0 ends itself with SIGKILL after step 3" in p.stderr
    assert [m["step"] for m in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    assert [c.name for c in checkpoint.list_checkpoints(out)] == ["step_000002"]


@pytest.mark.parametrize("name,points", [("ckpt", 3), ("data", 2), ("convert", 2)])
def test_sigkill_never_leaves_a_half_written_output(name, points, tmp_path):
    drill = _drill_module()
    r = drill.run_drill(name, points, seed=7, work=tmp_path / name, log=lambda m: None)
    bad = [row for row in r["rows"] if row["problems"]]
    assert r["half_written"] == 0, bad


# ------------------------------------------------------------------------------------------ disk full


def _can_mount_tmpfs() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs (in its own mount namespace)"
    if not shutil.which("unshare"):
        return "needs unshare(1) for a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs here: {probe.stderr.strip()[:200]}"
    return None


def _in_small_tmpfs(tmp_path: Path, size: str, script: str) -> subprocess.CompletedProcess:
    """Run python `script` in a new mount namespace where `<tmp_path>/small` is a tmpfs of `size`."""
    small = tmp_path / "small"
    small.mkdir(exist_ok=True)
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    cmd = (f'mount -t tmpfs -o size={size} tmpfs "{small}" && '
           f'exec "{sys.executable}" "{tmp_path / "script.py"}" "{small}"')
    return subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=_env(),
                          timeout=1200)


DISK_FULL_SCRIPT = r"""
import json, os, subprocess, sys
from pathlib import Path
small = Path(sys.argv[1])
root = Path(os.environ["PYTHONPATH"])
def labkit(*a):
    p = subprocess.run([sys.executable, "-m", "labkit", *map(str, a)], capture_output=True, text=True)
    errors = [l for l in p.stderr.splitlines() if ": error:" in l]
    return {"code": p.returncode, "errors": errors, "traceback": "Traceback" in p.stderr, "tail": p.stderr[-1500:]}
def left(): return sorted(p.name for p in small.iterdir() if p.name != "ballast")
out = {}
src, corpus = sys.argv[2], sys.argv[3]
out["convert"] = {**labkit("convert", "hf2ms", "--src", src, "--dst", small / "converted"), "left": left()}
out["data"] = {**labkit("data", "build", "--corpus", corpus, "--tokenizer", root / "data/tokenizer", "--seq-len", 64,
                        "--output", small / "dataset"), "left": left()}
print(json.dumps(out))
"""


@pytest.mark.skipif(bool(_can_mount_tmpfs()), reason=str(_can_mount_tmpfs()))
def test_disk_full_convert_and_data_build(tmp_path):
    from labkit.weights import parity

    hf = parity.make_hf_llama(tmp_path / "hf", seed=2)  # ~0.6 MB of weights, ~1 MB dataset below
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} " + "the quick brown fox " * 20}) + "\n"
                              for i in range(2000)))
    script = DISK_FULL_SCRIPT.replace("sys.argv[2], sys.argv[3]", f"{str(hf)!r}, {str(corpus)!r}")
    p = _in_small_tmpfs(tmp_path, "256k", script)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["code"] == 1 and not r["traceback"], (name, r["tail"])
        assert len(r["errors"]) == 1 and "no space left on device" in r["errors"][0], (name, r["errors"])
        assert r["left"] == [], (name, r["left"])  # neither the output nor a .tmp-* folder


TRAIN_FULL_SCRIPT = r"""
import json, os, subprocess, sys
from pathlib import Path
from labkit.config import load_run_config
from labkit.model.shapes import num_params
small = Path(sys.argv[1])
run = small / "run"
ballast = small / "ballast"
SETS = None  # the test's SMALL_SETS
def train(*extra):
    p = subprocess.run([sys.executable, "-m", "labkit", "train", "--output", str(run), "--set", "train.save_every=1",
                        *SETS, *extra], capture_output=True, text=True)
    return {"code": p.returncode, "errors": [l for l in p.stderr.splitlines() if ": error:" in l],
            "traceback": "Traceback" in p.stderr, "tail": p.stderr[-1500:]}
# A checkpoint holds the float32 weights and AdamW's two moments: about 12 bytes per parameter. The run gets room for
# 1.5 of them, so step 1's checkpoint fits and step 2's cannot, however far off the estimate (within a third) is.
ckpt = 12 * num_params(load_run_config(Path(os.environ["PYTHONPATH"]) / "configs/tiny_cpu.yaml", SETS[1::2]).model_config())
free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
ballast.write_bytes(b"\0" * max(0, free - 3 * ckpt // 2))
out = {"full": train("--steps", "3")}
out["after_full"] = sorted(p.name for p in (run / "checkpoints").iterdir())
out["ckpt_ratio"] = (run / "checkpoints" / "step_000001" / "state.ckpt").stat().st_size / ckpt
ballast.unlink()
out["resumed"] = train("--steps", "3", "--resume")
out["after_resume"] = sorted(p.name for p in (run / "checkpoints").iterdir())
print(json.dumps(out))
"""


@pytest.mark.skipif(bool(_can_mount_tmpfs()), reason=str(_can_mount_tmpfs()))
def test_disk_full_stops_training_and_resume_works_after(tmp_path):
    """One run saves step 1 and finds no room for step 2 (a run of its own to write step 1 first cost one more
    process start and compile: 22 CPU-s for the test against 15); then it resumes once space is freed."""
    script = TRAIN_FULL_SCRIPT.replace("SETS = None", f"SETS = {SMALL_SETS!r}")
    p = _in_small_tmpfs(tmp_path, "256m", script)  # 3 checkpoints of ~35 MB at once (one layer)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    full = r["full"]
    assert full["code"] == 1 and not full["traceback"], full["tail"]
    assert len(full["errors"]) == 1 and "no space left on device" in full["errors"][0], full["errors"]
    assert r["after_full"] == ["step_000001"], r["after_full"]  # step 1 complete, the half-written step 2 gone
    assert 2 / 3 < r["ckpt_ratio"] < 4 / 3, r["ckpt_ratio"]  # the room left was 1.5 checkpoints: one, not two
    assert r["resumed"]["code"] == 0, r["resumed"]["tail"]
    assert r["after_resume"] == ["step_000002", "step_000003"], r["after_resume"]


# ------------------------------------------------------------------------------------------ output lock


def test_output_lock_one_writer_per_node_rank(tmp_path):
    import socket

    from labkit.io import OutputLock, lock_name

    run = tmp_path / "run"
    with OutputLock(run, 0, "labkit train") as mine:
        assert (run / lock_name(0)).is_file() and mine.owned
        OutputLock(run, 0).acquire()  # this process again (a notebook calling train twice): shared, not refused
        with OutputLock(run, 1, "labkit launch") as other_node:  # node 1 writes the same folder beside node 0
            assert other_node.owned and (run / lock_name(1)).is_file()
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            (run / lock_name(2)).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                        "command": "labkit train", "started": "then"}))
            with pytest.raises(LabkitError, match=rf"being written by another run: labkit train \(pid {holder.pid}"):
                OutputLock(run, 2).acquire()
        finally:
            holder.kill()
            holder.wait()
        stale = OutputLock(run, 2).acquire()  # its writer is gone (SIGKILL leaves the file): taken over
        assert stale.owned and json.loads((run / lock_name(2)).read_text())["pid"] == os.getpid()
        stale.release()
    assert sorted(p.name for p in run.iterdir()) == []


def test_a_lock_held_by_a_parent_is_shared(tmp_path):
    """labkit launch holds the node's lock; the `labkit train` it starts (a child) writes under it."""
    from labkit.io import OutputLock

    with OutputLock(tmp_path, 0, "labkit launch"):
        code = "import sys; from labkit.io import OutputLock; l = OutputLock(sys.argv[1], 0).acquire(); print(l.owned)"
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=_env())
        assert p.stdout.strip() == "False", p.stderr
