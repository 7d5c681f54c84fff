"""Notebook 08's helpers that join layers: the planner's memory need for a CPU training run, and the out-of-memory
probe that quotes it (labkit.training.monitor runs and classifies; the planner lives above the trainer's layer)."""
from __future__ import annotations

from functools import partial

from labkit.config import load_run_config
from labkit.parallel.memory import memory_breakdown
from labkit.training.monitor import train_capped


def predicted_mb(cfg, micro_batch: int) -> dict:
    """The planner's memory model for this run config on one CPU process (fp32, no flash attention, no fused
    norm), MB by part. It leaves out the framework's own overhead (graph compile, allocator pools, libraries)."""
    t = cfg.train
    parts = memory_breakdown(cfg.model_config(), seq_len=cfg.data.seq_len, micro_batch=micro_batch, accum=t.accum,
                             recompute="full" if t.recompute == "all" else "none", precision="fp32",
                             flash_attention=False, fused_norm=False)
    return {k: round(v * 1024, 1) for k, v in parts.items() if k not in ("stage", "params")}


def oom_probe(config: str, limit_mb: float, sets: list[str] | tuple = ()):
    """probe(micro_batch) for `monitor.halve_until_fits`: a capped `labkit train` whose report quotes the planner."""
    cfg = load_run_config(config, list(sets))
    return partial(_probe, config, limit_mb, list(sets), cfg)


def _probe(config, limit_mb, sets, cfg, micro_batch: int) -> dict:
    return train_capped(config, micro_batch, limit_mb, sets, predict=partial(predicted_mb, cfg))
