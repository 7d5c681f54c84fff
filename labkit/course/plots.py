"""Plots for notebooks: static comparisons of runs, and one live view (display handles updated in place in
JupyterLab; under papermill/nbval the last state is what the executed notebook keeps) with two feeds:
LivePlot, an `on_step` callback of the trainer in this process, and labkit.course.pretrain.follow.Follower,
which tails metrics.jsonl written by another process."""
from __future__ import annotations

import sys

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s"))
# a panel is (metrics key, title) or (metrics key, title, scale): the plotted value is row[key] * scale


def draw(fig, runs: dict[str, list[dict]], panels=PANELS, title: str | None = None) -> None:
    """One panel per metric, one line per run (label -> metrics rows), on an existing matplotlib Figure."""
    for i, (key, label, *scale) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for name, rows in runs.items():
            pts = [(r["step"], r[key] * (scale[0] if scale else 1)) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 30 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
        if i == 0 and len(runs) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()


def figure_png(runs: dict[str, list[dict]] | list[dict], panels=PANELS, title: str | None = None) -> bytes:
    """draw() as PNG bytes (matplotlib's object API, no pyplot: safe off the main thread). `runs` may be one
    run's rows."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.5 * len(panels), 3))
    FigureCanvasAgg(fig)
    draw(fig, runs if isinstance(runs, dict) else {"run": runs}, panels, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    return buf.getvalue()


def compare(runs: dict[str, list[dict]], panels=PANELS, title: str | None = None):
    """A static figure comparing runs (label → metrics rows)."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(4 * len(panels), 3))
    draw(fig, runs, panels, title)
    plt.close(fig)
    return fig


class Text:
    """A plain-text display object (its repr is the text)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def display_function():
    """IPython's `display` when a shell (a kernel) is running, else None (a script, the CLI)."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
    except ImportError:
        return None
    return display if InteractiveShell.initialized() else None


class LiveView:
    """A figure of metrics rows, optionally a status line above it, and at most one warning line, each a display
    handle redrawn in place. Without a kernel it draws nothing, and a warning goes to stderr."""

    def __init__(self, panels=PANELS, label: str = "run", status=None):
        self.panels, self.label, self.status = panels, label, status  # status(rows) -> str, or None
        self.warning, self.handles = None, {}
        self.display = display_function()
        if self.display is None:
            return
        if status is not None:
            self.handles["status"] = self.display(Text(status([])), display_id=True)
        self.handles["figure"] = self.display(self._image([]), display_id=True)

    def _image(self, rows: list[dict]):
        from IPython.display import Image

        return Image(data=figure_png({self.label: rows}, self.panels))

    def show(self, rows: list[dict]) -> None:
        """Redraw the status line and the figure for these rows."""
        if "status" in self.handles:
            self.handles["status"].update(Text(self.status(rows)))
        if "figure" in self.handles:
            self.handles["figure"].update(self._image(rows))

    def warn(self, message: str) -> None:
        """Show a warning line under the figure, once (later warnings are dropped: the first one is the cause);
        without a kernel it goes to stderr."""
        if self.warning is not None:
            return
        self.warning = message
        if self.display is None:
            print(f"warning: {message}", file=sys.stderr)
        else:
            self.handles["warning"] = self.display(Text(f"warning: {message}"), display_id=True)


class LivePlot:
    """`on_step` callback for labkit.training.trainer: redraws the live view every `every` steps."""

    def __init__(self, every: int = 5, panels=PANELS, label: str = "run"):
        self.every, self.rows = every, []
        self.view = LiveView(panels, label)

    def __call__(self, rec: dict) -> None:
        self.rows.append(rec)
        if len(self.rows) % self.every == 0:
            self.view.show(self.rows)

    def close(self) -> None:
        self.view.show(self.rows)
