"""Plots for notebooks: a live training plot (display handle: updates in place in JupyterLab, one final image
under papermill/nbval) and static comparisons of runs."""
from __future__ import annotations

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s"))


def _figure(runs: dict[str, list[dict]], panels=PANELS, title: str | None = None):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (key, label) in zip(axes, panels):
        for name, hist in runs.items():
            rows = [r for r in hist if key in r]
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=name)
        ax.set_title(label)
        ax.set_xlabel("step")
    if len(runs) > 1:
        axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


def compare(runs: dict[str, list[dict]], panels=PANELS, title: str | None = None):
    """A static figure comparing runs (label → metrics rows)."""
    return _figure(runs, panels, title)


class LivePlot:
    """`on_step` callback for labkit.training.trainer: redraws every `every` steps into one display handle."""

    def __init__(self, every: int = 5, panels=PANELS, label: str = "run"):
        self.every, self.panels, self.label, self.rows = every, panels, label, []
        self.handle = None
        try:
            from IPython.display import display

            self.handle = display(_figure({label: []}, panels), display_id=True)
        except Exception:  # no IPython: a script or CLI run
            self.handle = None

    def __call__(self, rec: dict) -> None:
        self.rows.append(rec)
        if self.handle is not None and len(self.rows) % self.every == 0:
            self.handle.update(_figure({self.label: self.rows}, self.panels))

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update(_figure({self.label: self.rows}, self.panels))
