"""Running the resolved run: `labkit launch` with a live view of loss, tokens/s, MFU and memory from metrics.jsonl."""
from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

from labkit.course import plots
from labkit.course.pretrain.outputs import write_configs
from labkit.course.pretrain.runspec import PretrainRun
from labkit.errors import LabkitError, LabkitFailure
from labkit.launch import launcher
from labkit.training.metrics import read_metrics

PANELS = (("loss", "loss", 1), ("tokens_per_s", "tokens/s", 1), ("mfu", "MFU %", 100),
          ("peak_mem_mb", "peak memory MB", 1))


def figure_png(rows: list[dict], title: str = "") -> bytes:
    """Loss, throughput, MFU and memory by step as PNG bytes (safe off the main thread)."""
    return plots.figure_png(rows, PANELS, title)


def status_line(rows: list[dict], steps: int) -> str:
    if not rows:
        return f"waiting for step 1 of {steps} (imports, dataset, graph compilation) ..."
    r = rows[-1]
    return (f"step {r['step']}/{steps}  loss {r['loss']:.4f}  {r['tokens_per_s']:,.0f} tokens/s  MFU {r['mfu']:.1%}  "
            f"peak memory {r['peak_mem_mb']:,.0f} MB  lr {r['lr']:.2e}")


FIGURES = 8  # about how many times the live figure is redrawn over a run (the status line: at every poll)


def figure_every(steps: int) -> int:
    """Steps between two redraws of the live figure of a run of `steps` steps."""
    return max(1, math.ceil(steps / FIGURES))


def figure_steps(steps: int) -> list[int]:
    """The steps at which the live figure of a run of `steps` steps (every one logged) is redrawn: every
    figure_every(steps) steps, and the last. At least two for a run of two steps or more."""
    every = figure_every(steps)
    return sorted(set(range(every, steps + 1, every)) | {steps})


class Follower(threading.Thread):
    """Reads rank 0's metrics.jsonl every `every` seconds; the status line shows the newest row, and the figure is
    redrawn at the steps of figure_steps(), each one in order even when one read brings several (a fast run, a slow
    poll), and at stop() for a run that ended between them. The number of redraws depends on the steps the run
    logged, not on how fast it logged them. A failure to read or draw is shown once as a warning line, and
    following goes on."""

    def __init__(self, metrics: Path, steps: int, every: float = 1.0):
        super().__init__(daemon=True)
        self.metrics, self.steps, self.every, self.seen = Path(metrics), steps, every, -1
        self.per_figure = figure_every(steps)
        self._stop_event, self._lock = threading.Event(), threading.Lock()
        self.view = plots.LiveView(PANELS, label="rank 0", status=lambda rows: status_line(rows, steps),
                                   steps=steps)

    def _due(self, step: int) -> bool:
        drawn = self.view.step
        return step > drawn and (step // self.per_figure > drawn // self.per_figure or step == self.steps)

    def refresh(self, final: bool = False) -> None:
        """Draw every figure due among the rows not read before (`final`: also the last row, if not drawn), then
        the status line if there are new rows."""
        with self._lock:
            rows = read_metrics(self.metrics.parent)
            if len(rows) < self.seen:  # rewritten shorter (a resumed run): read it again from its start
                self.seen, self.view.step = -1, 0
            for i in range(max(self.seen, 0), len(rows)):
                if self._due(rows[i]["step"]):
                    self.view.draw(rows[:i + 1])
            if final and rows and rows[-1]["step"] != self.view.step:
                self.view.draw(rows)
            if len(rows) != self.seen:
                self.seen = len(rows)
                self.view.tell(rows)

    def poll(self, final: bool = False) -> None:
        """refresh(), reporting (once) instead of raising: a display hiccup must not end the run."""
        try:
            self.refresh(final)
        except Exception as e:  # shown to the reader once, not swallowed
            self.view.warn(f"the live view of {self.metrics} failed: {type(e).__name__}: {e}")

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        if self.ident is not None:  # started
            self.join()
        self.poll(final=True)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


def launch(run: PretrainRun, *, live: bool | None = None, timeout: float | None = None):
    """Start the run through `labkit launch` (one worker: `labkit train` in a child process; more: msrun) and
    follow it live. Returns the LaunchResult; a failed run raises LabkitFailure with the failing rank's log."""
    if not run.can_train:
        raise LabkitError(f"this machine cannot run it: {run.why_not}", "see launch.sh for the commands to use")
    if not (run.output_dir / "run.yaml").exists():
        write_configs(run)
    live = _in_notebook() if live is None else live
    follower = Follower(run.output_dir / "metrics.jsonl", run.cfg.train.steps) if live else None
    if follower:
        follower.start()
    try:
        spec = launcher.LaunchSpec(run.cfg, run.workers, output=str(run.output_dir), nodes=run.nodes,
                                   node_rank=run.node_rank, master_addr=run.master_addr, master_port=run.master_port,
                                   resume=run.resume, overwrite=run.overwrite and not run.resume)
        res = launcher.launch(spec, progress=not live, timeout=timeout, show_report=False,
                              log=lambda m: print(m, file=sys.stderr))
    finally:
        if follower:
            follower.stop()
    if not res.ok:
        raise LabkitFailure(f"the run failed: {res.reason}", res.report())
    return res
