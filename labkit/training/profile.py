"""Where a training step's time goes: a top-operators table per framework, from each framework's own profiler.

MindSpore: `mindspore.profiler.Profiler` around a few steady steps of labkit's Trainer (after the warm-up steps the
throughput figures skip too); its `cpu_op_type_info_*.csv` sums time by operator type. PyTorch: `torch.profiler`
around a few steps of any step function, self CPU time by operator. Both tables give milliseconds per step and the
share of all operator time; they answer "which operators to fuse or replace", not "how long is a step" (profiling
slows a step, and operator times overlap across threads).
"""
from __future__ import annotations

import csv
import tempfile
from pathlib import Path

from labkit.training.metrics import WARMUP_STEPS


def table(times_ms: dict[str, float], steps: int, top: int = 15) -> list[dict]:
    """Rows {op, ms_per_step, share}, largest first."""
    total = sum(times_ms.values()) or 1.0
    rows = sorted(times_ms.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": op, "ms_per_step": ms / steps, "share": ms / total} for op, ms in rows]


def mindspore_op_times(folder) -> dict[str, float]:
    """Total milliseconds by operator type from a MindSpore CPU profile folder."""
    times: dict[str, float] = {}
    for f in Path(folder).rglob("cpu_op_type_info_*.csv"):
        with open(f, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                times[row["op_type"]] = times.get(row["op_type"], 0.0) + float(row["total_compute_time"])
    return times


def profile_labkit(preset: str, micro_batch: int, seq_len: int, kernels: str = "native", steps: int = 3,
                   warmup: int = WARMUP_STEPS, config: str = "configs/tiny_cpu.yaml") -> list[dict]:
    """Top operators of labkit's MindSpore training step (float32, no accumulation) over `steps` steady steps."""
    from mindspore.profiler import Profiler

    from labkit.config import load_run_config
    from labkit.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="labkit_profile_") as tmp:
        cfg = load_run_config(config, [
            f"model.preset={preset}", f"output_dir={tmp}/run", f"train.steps={warmup}", "train.accum=1",
            f"train.micro_batch={micro_batch}", f"data.seq_len={seq_len}", "train.save_every=0",
            "train.peak_tflops=1", "train.amp_level=O0", f"train.kernels={kernels}"])
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.run()  # compile and warm-up, outside the profile
        cfg.train.steps = warmup + steps
        prof = Profiler(output_path=f"{tmp}/profile")
        trainer.run()
        prof.stop()
        prof.analyse()
        return table(mindspore_op_times(f"{tmp}/profile"), steps)


def profile_torch(step, steps: int = 3) -> list[dict]:
    """Top operators (self CPU time) of `steps` calls of `step()` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    times = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return table(times, steps)
