"""Notebook 08a's helpers that join layers: the out-of-memory probe that quotes the planner's memory need
(`labkit.training.oom.planner_need_mb`; labkit.training.monitor runs and classifies), a comparison judged against
the seed-to-seed spread, and the activation lab."""
from __future__ import annotations

from functools import partial

from labkit.config import load_run_config, model_preset
from labkit.errors import LabkitFailure
from labkit.layout import Layout
from labkit.logs import quiet_mindformers
from labkit.model.llama import build_model
from labkit.parallel.memory import Numerics, memory_breakdown
from labkit.runtime import prepare_process, process_env
from labkit.training.metrics import POOL_STATS_ENV, pool_peaks_mb
from labkit.training.monitor import train_capped
from labkit.training.oom import planner_need_mb


def oom_probe(config: str, limit_mb: float, sets: list[str] | tuple = ()):
    """probe(micro_batch) for `monitor.halve_until_fits`: a capped `labkit train` whose report quotes the planner."""
    cfg = load_run_config(config, list(sets))
    return partial(_probe, config, limit_mb, list(sets), cfg)


def _probe(config, limit_mb, sets, cfg, micro_batch: int) -> dict:
    return train_capped(config, micro_batch, limit_mb, sets, predict=partial(planner_need_mb, cfg))


def beyond_seed_noise(values: list[float], against: list[float]) -> tuple[float, float, bool | None]:
    """(difference of the means, seed-to-seed spread, verdict) of one setting's per-seed results against another's,
    lower being better (a loss). The spread is the larger range over the seeds of either setting, measured in the
    same run; the difference counts only beyond it: True if lower by more, False if higher by more, None within it
    (the run cannot tell the settings apart)."""
    if len(values) < 2 or len(against) < 2:
        raise ValueError("a seed-to-seed spread needs at least two seeds of each setting")
    diff = sum(values) / len(values) - sum(against) / len(against)
    spread = max(max(values) - min(values), max(against) - min(against))
    return diff, spread, (True if diff < -spread else False if diff > spread else None)


# ---------------------------------------------------------------- lab 4: activation memory against sequence length
# MindSpore prints its memory-pool statistics only when a process ends, and a process keeps its highest peak, so
# each sequence length needs a process of its own. One child imports MindSpore and mindformers once and forks a
# grandchild per length (bench/plan_calibration.py does the same); a grandchild trains a few steps and exits like a
# normal interpreter, which prints the statistics into its log. The step is the forward and backward pass of
# bench/plan_calibration.py's calibrated step (build_model + value_and_grad, float32, GRAPH mode) without the
# optimizer: its update adds nothing that depends on the sequence length, and compiling it would double the cost.

_MARK = "labkit seq_memory: "  # the result line among whatever MindSpore prints


def planner_activations_mb(cfg, seq_len: int, micro_batch: int) -> float:
    """The planner's activations of one micro-batch on this CPU (fp32, no flash attention, unfused RMSNorm and
    SiLU), MiB: what MindSpore's memory pool holds at the end of the forward pass, its peak; weights are
    Parameters, outside the pool."""
    cpu = Numerics(amp_level="O0", flash_attention=False, fused_norm=False, fused_silu=False)
    return memory_breakdown(cfg, Layout(micro_batch=micro_batch), seq_len=seq_len,
                            numerics=cpu)["activations"] * 1024  # GiB -> MiB


def seq_memory(seqs=(64, 128, 256), micro_batch: int = 8, preset: str = "tiny", steps: int = 1,
               timeout: float = 900) -> list[dict]:
    """Measured memory-pool peak (MiB: `live` tensors, and the address `span`) of `steps` training steps of the
    `preset` model at each sequence length (forward and backward pass), beside the planner's activations."""
    import json
    import os
    import subprocess
    import sys


    spec = {"seqs": list(seqs), "micro_batch": micro_batch, "preset": preset, "steps": steps}
    env = {**process_env("CPU"), **os.environ, **POOL_STATS_ENV}
    p = subprocess.run([sys.executable, "-m", "labkit.course.troubleshoot", json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [line[len(_MARK):] for line in p.stdout.splitlines() if line.startswith(_MARK)]
    if p.returncode or not lines:
        raise LabkitFailure(f"the sequence-length memory probe failed (exit {p.returncode})", p.stderr[-2000:])
    cfg = model_preset(preset)
    return [{**row, "planner_activations_mb": planner_activations_mb(cfg, row["seq_len"], micro_batch)}
            for row in json.loads(lines[-1])]


def _seq_memory_main(spec: dict) -> None:
    import json
    import shutil
    import tempfile
    from pathlib import Path


    quiet_mindformers()  # before mindformers' import: without torch, HF datasets and nltk
    import mindformers  # noqa: F401
    import mindspore  # noqa: F401 - imported once here, inherited by every forked child
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="labkit_seq_memory_"))  # no context manager: a forked child
    for seq in spec["seqs"]:  # leaves through SystemExit and must not remove the folder its parent still reads
        log = tmp / f"seq{seq}.log"
        status = _fork_steps(spec, seq, log)
        peaks = pool_peaks_mb(log.read_text(errors="replace")) or {}
        rows.append({"seq_len": seq, "micro_batch": spec["micro_batch"], "exit_status": status,
                     "live_mb": peaks.get("live"), "span_mb": peaks.get("span")})
    shutil.rmtree(tmp, ignore_errors=True)
    print(_MARK + json.dumps(rows), flush=True)


def _fork_steps(spec: dict, seq: int, log) -> int:
    """Fork; the child trains spec["steps"] steps at `seq` with its output in `log`, then exits like an interpreter."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's loop
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        _train_steps(spec["preset"], seq, spec["micro_batch"], spec["steps"])
        raise SystemExit(0)
    return os.waitpid(pid, 0)[1]


def _train_steps(preset: str, seq: int, micro_batch: int, steps: int) -> None:
    import mindspore as ms
    import numpy as np


    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = model_preset(preset)
    model = build_model(cfg, seq_length=seq, batch_size=micro_batch, seed=0)
    model.set_train(True)
    grad_fn = ms.jit(ms.value_and_grad(model, None, model.trainable_params()))

    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.integers(1, cfg.vocab_size, size=(micro_batch, seq + 1)).astype(np.int32)
        loss, grads = grad_fn(ms.Tensor(x))
        loss.asnumpy()


if __name__ == "__main__":
    import json as _json
    import sys as _sys

    prepare_process("CPU")
    _seq_memory_main(_json.loads(_sys.argv[1]))
