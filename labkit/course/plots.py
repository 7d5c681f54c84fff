"""Plots for notebooks: static comparisons of runs, and one live view (display handles updated in place in
JupyterLab; under papermill/nbval the last state is what the executed notebook keeps) with two feeds:
LivePlot, an `on_step` callback of the trainer in this process, and labkit.course.pretrain.follow.Follower,
which tails metrics.jsonl written by another process."""
from __future__ import annotations

import functools
import html
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


@functools.cache
def _image_class():
    """IPython's Image, also offered as text/html: the same PNG in an <img> whose alt text and data-update /
    data-step attributes say which redraw of a live view it is (JupyterLab gives a bare image/png no alt text).
    Made on first use: IPython is imported only when there is a kernel."""
    from IPython.display import Image as IPythonImage

    class Image(IPythonImage):  # IPython's name: code that looks for images among the outputs finds these
        def __init__(self, png: bytes, alt: str, **attrs):
            super().__init__(data=png, format="png", alt=alt)
            self.attrs = attrs

        def _repr_mimebundle_(self, include=None, exclude=None):
            data, metadata = super()._repr_mimebundle_(include, exclude)
            b64 = data["image/png"]
            extra = "".join(f' data-{k}="{v}"' for k, v in self.attrs.items())
            alt = html.escape(self.alt, quote=True)
            data.update({"text/html": f'<img src="data:image/png;base64,{b64}" alt="{alt}" title="{alt}"{extra}>',
                         "text/plain": self.alt})
            return data, metadata

    return Image


def figure_image(png: bytes, alt: str, **attrs):
    """A PNG to display(), with its alt text and data-* attributes in the page (see _image_class)."""
    return _image_class()(png, alt, **attrs)


class LiveView:
    """A figure of metrics rows, optionally a status line above it, and at most one warning line, each a display
    handle redrawn in place. Without a kernel it draws nothing, and a warning goes to stderr.

    The figure counts its redraws: `updates` (0: the empty figure shown first) and the step of the last row drawn
    are in the page, as the image's alt text and its data-update / data-step attributes, so a reader of the page
    knows which state it shows without timing anything. `steps`, when known, is the step the run ends at."""

    def __init__(self, panels=PANELS, label: str = "run", status=None, steps: int | None = None):
        self.panels, self.label, self.status, self.steps = panels, label, status, steps  # status(rows) -> str
        self.warning, self.handles, self.updates, self.step = None, {}, 0, 0
        self.display = display_function()
        if self.display is None:
            return
        if status is not None:
            self.handles["status"] = self.display(Text(status([])), display_id=True)
        self.handles["figure"] = self.display(self._image([]), display_id=True)

    def caption(self) -> str:
        of = f" of {self.steps}" if self.steps else ""
        titles = ", ".join(p[1] for p in self.panels)
        return f"{self.label}: {titles} by step; update {self.updates}, step {self.step}{of}"

    def _image(self, rows: list[dict]):
        png = figure_png({self.label: rows}, self.panels)
        return figure_image(png, self.caption(), update=self.updates, step=self.step)

    def draw(self, rows: list[dict]) -> None:
        """Redraw the figure for these rows: one more update, whether it adds one step or many."""
        self.updates, self.step = self.updates + 1, rows[-1]["step"] if rows else 0
        if "figure" in self.handles:
            self.handles["figure"].update(self._image(rows))

    def tell(self, rows: list[dict]) -> None:
        """Rewrite the status line for these rows."""
        if "status" in self.handles:
            self.handles["status"].update(Text(self.status(rows)))

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
    """`on_step` callback for labkit.training.trainer: redraws the live view every `every` steps, and at close()
    if steps came after the last redraw (a run of n steps redraws n // every times, and once more if n is not a
    multiple of `every`)."""

    def __init__(self, every: int = 5, panels=PANELS, label: str = "run"):
        self.every, self.rows = every, []
        self.view = LiveView(panels, label)

    def __call__(self, rec: dict) -> None:
        self.rows.append(rec)
        if len(self.rows) % self.every == 0:
            self.view.draw(self.rows)

    def close(self) -> None:
        if self.rows and self.view.step != self.rows[-1]["step"]:
            self.view.draw(self.rows)
