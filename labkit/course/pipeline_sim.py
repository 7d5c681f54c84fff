"""The pipeline schedules simulated: GPipe and 1F1B timelines for p stages and m micro-batches, their idle share
(the bubble, (p - 1) / m: Narayanan et al. 2021, section 2.2) and the micro-batches each stage holds at its peak.

The lab's real 2-stage pipeline (labkit.byhand.pipeline_parallel) runs the same per-stage order of forwards and
backwards (tests/test_pipeline_sim.py checks it); this simulation draws any p and m with chosen pass times."""
from __future__ import annotations


def pipeline_schedule(stages: int, micro_batches: int, schedule: str = "1f1b", t_forward=1.0,
                      t_backward=2.0) -> list[dict]:
    """Simulate a pipeline step: each stage runs its forward (F) and backward (B) passes in the schedule's order,
    as soon as the previous stage's forward (or the next stage's backward) of that micro-batch is done.

    gpipe: all forwards, then all backwards. 1f1b (PipeDream-Flush): stage i runs p - i - 1 warm-up forwards, then
    alternates one forward and one backward. `t_forward`/`t_backward`: one time for every stage, or a list of one
    per stage (stages of unequal cost). Returns events {stage, kind, micro, start, end}."""
    p, m = stages, micro_batches
    per_stage = lambda t: list(t) if isinstance(t, (list, tuple)) else [t] * p  # noqa: E731
    t_f, t_b = per_stage(t_forward), per_stage(t_backward)
    if p < 1 or m < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    orders = []
    for i in range(p):
        if schedule == "gpipe":
            order = [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
        elif schedule == "1f1b":
            warm = min(p - i - 1, m)
            order = [("F", k) for k in range(warm)]
            for k in range(m - warm):
                order += [("F", warm + k), ("B", k)]
            order += [("B", k) for k in range(m - warm, m)]
        else:
            raise ValueError(f"schedule '{schedule}' is not known: use gpipe or 1f1b")
        orders.append(order)
    done: dict[tuple, float] = {}
    free = [0.0] * p
    pos = [0] * p
    events = []
    while any(pos[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            if pos[i] >= len(orders[i]):
                continue
            kind, k = orders[i][pos[i]]
            dep = ("F", i - 1, k) if kind == "F" and i > 0 else ("B", i + 1, k) if kind == "B" and i < p - 1 \
                else ("F", i, k) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[i], done.get(dep, 0.0))
            end = start + (t_f[i] if kind == "F" else t_b[i])
            done[(kind, i, k)] = end
            free[i] = end
            pos[i] += 1
            events.append({"stage": i, "kind": kind, "micro": k, "start": start, "end": end})
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # cannot happen for gpipe / 1f1b
    return events


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
