"""Running the resolved run: `labkit launch` with a live view of loss, tokens/s, MFU and memory from metrics.jsonl."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from labkit.errors import LabkitError, LabkitFailure
from labkit.course import plots
from labkit.course.pretrain.runspec import PretrainRun
from labkit.course.pretrain.outputs import write_configs


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


class Follower(threading.Thread):
    """Reads rank 0's metrics.jsonl every `every` seconds and redraws a live view (status line and figure) when
    rows were added; a failure to read or draw is shown once as a warning line, and following goes on."""

    def __init__(self, metrics: Path, steps: int, every: float = 2.0):
        super().__init__(daemon=True)
        self.metrics, self.steps, self.every, self.seen = Path(metrics), steps, every, -1
        self._stop_event = threading.Event()
        self.view = plots.LiveView(PANELS, label="rank 0", status=lambda rows: status_line(rows, steps))

    def refresh(self) -> None:
        from labkit.training.metrics import read_metrics

        rows = read_metrics(self.metrics.parent)
        if len(rows) != self.seen:
            self.seen = len(rows)
            self.view.show(rows)

    def poll(self) -> None:
        """refresh(), reporting (once) instead of raising: a display hiccup must not end the run."""
        try:
            self.refresh()
        except Exception as e:  # shown to the reader once, not swallowed
            self.view.warn(f"the live view of {self.metrics} failed: {type(e).__name__}: {e}")

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        self.poll()


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


def launch(run: PretrainRun, *, live: bool | None = None, timeout: float | None = None):
    """Start the run through `labkit launch` (one worker: `labkit train` in a child process; more: msrun) and
    follow it live. Returns the LaunchResult; a failed run raises LabkitFailure with the failing rank's log."""
    from labkit.launch import launcher

    if not run.can_train:
        raise LabkitError(f"this machine cannot run it: {run.why_not}", "see launch.sh for the commands to use")
    if not (run.output_dir / "run.yaml").exists():
        write_configs(run)
    live = _in_notebook() if live is None else live
    follower = Follower(run.output_dir / "metrics.jsonl", run.cfg.train.steps) if live else None
    if follower:
        follower.start()
    try:
        res = launcher.launch(run.cfg, run.workers, output=str(run.output_dir), nodes=run.nodes,
                              node_rank=run.node_rank, master_addr=run.master_addr, master_port=run.master_port,
                              resume=run.resume, overwrite=run.overwrite and not run.resume, progress=not live,
                              timeout=timeout, show_report=False, log=lambda m: print(m, file=sys.stderr))
    finally:
        if follower:
            follower.stop()
    if not res.ok:
        raise LabkitFailure(f"the run failed: {res.reason}", res.report())
    return res
