"""Running the resolved run: `labkit launch` with a live view of loss, tokens/s, MFU and memory from metrics.jsonl."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from labkit.errors import LabkitError, LabkitFailure
from labkit.course.pretrain.runspec import PretrainRun
from labkit.course.pretrain.outputs import write_configs


PANELS = (("loss", "loss", 1), ("tokens_per_s", "tokens/s", 1), ("mfu", "MFU %", 100), ("peak_mem_mb", "peak memory MB", 1))


def figure_png(rows: list[dict], title: str = "") -> bytes:
    """Loss, throughput, MFU and memory by step as PNG bytes (matplotlib's object API: safe off the main thread)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 3))
    FigureCanvasAgg(fig)
    for i, (key, label, scale) in enumerate(PANELS):
        ax = fig.add_subplot(1, len(PANELS), i + 1)
        pts = [(r["step"], r[key] * scale) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    return buf.getvalue()


class _Text:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def status_line(rows: list[dict], steps: int) -> str:
    if not rows:
        return f"waiting for step 1 of {steps} (imports, dataset, graph compilation) ..."
    r = rows[-1]
    return (f"step {r['step']}/{steps}  loss {r['loss']:.4f}  {r['tokens_per_s']:,.0f} tokens/s  MFU {r['mfu']:.1%}  "
            f"peak memory {r['peak_mem_mb']:,.0f} MB  lr {r['lr']:.2e}")


class Follower(threading.Thread):
    """Reads rank 0's metrics.jsonl every `every` seconds and updates two display handles (a status line and the
    figure) in place; under papermill the last state is what the executed notebook keeps."""

    def __init__(self, metrics: Path, steps: int, every: float = 2.0):
        super().__init__(daemon=True)
        from IPython.display import Image, display

        self.metrics, self.steps, self.every, self.seen = Path(metrics), steps, every, -1
        self._stop_event = threading.Event()
        self.status = display(_Text(status_line([], steps)), display_id=True)
        self.plot = display(Image(data=figure_png([])), display_id=True)

    def refresh(self) -> None:
        from IPython.display import Image

        from labkit.training.metrics import read_metrics

        rows = read_metrics(self.metrics.parent)
        if len(rows) != self.seen:
            self.seen = len(rows)
            self.status.update(_Text(status_line(rows, self.steps)))
            self.plot.update(Image(data=figure_png(rows)))

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            try:
                self.refresh()
            except Exception:  # a half-written line or a display hiccup must not end the run
                pass

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        self.refresh()


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
