"""TensorBoard event files beside metrics.jsonl: every training run writes both, so `tensorboard --logdir runs/`
shows every run's curves live, and metrics.jsonl stays the file that tests and notebooks read.

The writer is tensorboardX (installed with mindformers); reading uses TensorBoard's own `EventAccumulator`, the
code TensorBoard's server runs, so a test that reads our files back checks what the reader will see."""
from __future__ import annotations

import math
from pathlib import Path

from labkit.runtime import before_protobuf

SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time_s", "mfu", "rss_mb", "val_loss", "val_ppl")
PREFIX = "train/"


class EventWriter:
    """Writes each step record's scalars as `train/<key>` at the record's step. A no-op when tensorboardX is
    missing (the run still has metrics.jsonl)."""

    def __init__(self, run_dir, flush_secs: int = 10):
        before_protobuf()
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            self.writer = None
            return
        self.writer = SummaryWriter(logdir=str(Path(run_dir)), flush_secs=flush_secs)

    def add(self, rec: dict) -> None:
        if self.writer is None:
            return
        for key in SCALARS:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(PREFIX + key, value, int(rec["step"]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def event_files(run_dir) -> list[Path]:
    return sorted(Path(run_dir).glob("events.out.tfevents.*"))


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would plot for this run folder: {key: [(step, value), ...]}, keys without the
    `train/` prefix. Needs the `tensorboard` package (the `lab` extra)."""
    before_protobuf()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir)), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        out[tag.removeprefix(PREFIX)] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return out
