"""The pipeline schedules simulated: GPipe and 1F1B timelines for p stages and m micro-batches, their idle share
(the bubble, (p - 1) / m: Narayanan et al. 2021, section 2.2) and the micro-batches each stage holds at its peak.

The schedule is the one the lab's hand-written pipeline runs (labkit.byhand.pipeline_parallel.simulate: its
workers execute their stage's part of this timeline); here it is drawn for any p and m with chosen pass times."""
from __future__ import annotations

from labkit.byhand.pipeline_parallel import simulate


def pipeline_schedule(stages: int, micro_batches: int, schedule: str = "1f1b", t_forward=1.0,
                      t_backward=2.0) -> list[dict]:
    """Simulate a pipeline step (labkit.byhand.pipeline_parallel.simulate, the schedule the lab's workers run):
    events {stage, kind, micro, start, end}. gpipe: all forwards, then all backwards; 1f1b (PipeDream-Flush):
    stage i runs p - i - 1 warm-up forwards, then alternates one forward and one backward. `t_forward` /
    `t_backward`: one time for every stage, or one per stage (stages of unequal cost)."""
    return simulate(stages, micro_batches, schedule, t_forward, t_backward)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle time relative to the ideal compute time: (p - 1) / m (GPipe and 1F1B alike)."""
    return (stages - 1) / micro_batches


def simulated_bubble(events: list[dict]) -> float:
    """Idle time over busy time per stage, from a simulated schedule (equals (p - 1) / m)."""
    stages = max(e["stage"] for e in events) + 1
    makespan = max(e["end"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events) / stages
    return (makespan - busy) / busy


def peak_in_flight(events: list[dict], stage: int = 0) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not yet)."""
    marks = sorted([(e["end"], 1) for e in events if e["stage"] == stage and e["kind"] == "F"]
                   + [(e["end"], -1) for e in events if e["stage"] == stage and e["kind"] == "B"],
                   key=lambda x: (x[0], x[1]))
    live = peak = 0
    for _, d in marks:
        live += d
        peak = max(peak, live)
    return peak


def plot_pipeline(events: list[dict], ax=None, title: str | None = None):
    """Gantt chart of a schedule: one row per stage, forwards blue, backwards orange, micro-batch numbers."""
    import matplotlib.pyplot as plt

    stages = max(e["stage"] for e in events) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 * stages + 1))
    for e in events:
        ax.broken_barh([(e["start"], e["end"] - e["start"])], (stages - 1 - e["stage"] - 0.4, 0.8),
                       facecolors="tab:blue" if e["kind"] == "F" else "tab:orange", edgecolors="white")
        ax.text((e["start"] + e["end"]) / 2, stages - 1 - e["stage"], str(e["micro"]), ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {stages - 1 - i}" for i in range(stages)])
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(title or f"bubble {simulated_bubble(events):.0%} of compute")
    return ax
