"""Pipeline parallelism by hand: p stages, m micro-batches, GPipe or 1F1B (Narayanan et al. 2021), composed with
data and tensor parallelism.

Stage i holds its share of the decoder layers (labkit.model.shapes.pipeline_layers), the first stage the
embedding, the last the final norm and the head. For micro-batch j, stage i's forward (F j) sends its output
activations a_j [b, s, h] (sequence-split under SP) to stage i + 1; the last stage's forward computes the loss, its
backward (B j) sends the gradient of its input back to stage i - 1, whose backward takes it. Between its F j and
B j a stage holds micro-batch j: here its stage input, and B j runs the forward again under autodiff before the
backward (full activation recompute, as Megatron does with `recompute_granularity=full`). MindSpore's PyNative
autodiff keeps only the most recent forward open for a backward (an older `ms.vjp` closure fails with "Can not find
top cell for backward"), and 1F1B needs the older one: B0 comes after F1.

One schedule serves the simulator and the workers (`simulate`): each stage's order of forwards and backwards
(`orders`: GPipe all forwards then all backwards; 1F1B p - i - 1 warm-up forwards, then one forward and one
backward in turn), each pass starting as soon as its stage is free and its input has arrived. A worker runs its
stage's part of that timeline (`programs`): the passes in the order they start, and before a pass the transfer
that brings its input, on the group of the two stages it joins.

A transfer is a rendezvous: both stages call it (the CPU backend has no Send/Receive: a broadcast or an
all-reduce, labkit.byhand.comm.Group.transfer). The programs are one sequence of the simulated timeline in which
every transfer sits just before the pass that consumes it, cut per stage; each stage meets its peers in that
sequence's order, so no two stages can wait for each other.

Each action is timed; the idle share of a stage's step is 1 - (its F and B time) / (its step's wall time), which
the schedule predicts as (p - 1) / (m + p - 1) when every F and B take the same time (the bubble (p - 1) / m of the
ideal time)."""
from __future__ import annotations

import time
from typing import NamedTuple

from labkit.byhand.comm import Op, sum_over
from labkit.errors import LabkitError
from labkit.model import scratch

SCHEDULES = ("gpipe", "1f1b")


class StageStep(NamedTuple):
    """One optimizer step of one stage: the micro-batches it held at once at its peak, its idle share, and its
    timeline, (action, micro-batch, start, end) rows in seconds from the step's start."""
    peak_held_microbatches: int
    idle_share: float
    timeline: tuple[tuple[str, int, float, float], ...]


def orders(stages: int, m: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Per stage, its forwards (F) and backwards (B) of micro-batches 0..m-1 in the schedule's order. gpipe: all
    forwards, then all backwards. 1f1b (PipeDream-Flush): stage i runs p - i - 1 warm-up forwards, then alternates
    one forward and one backward, then the remaining backwards."""
    if stages < 1 or m < 1:
        raise LabkitError(f"a pipeline of {stages} stages and {m} micro-batches", "use at least one of each")
    if schedule not in SCHEDULES:
        raise LabkitError(f"schedule '{schedule}' is not known", f"use one of {', '.join(SCHEDULES)}")
    out = []
    for i in range(stages):
        if schedule == "gpipe":
            out.append([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            continue
        warm = min(stages - i - 1, m)
        order = [("F", k) for k in range(warm)]
        for k in range(m - warm):
            order += [("F", warm + k), ("B", k)]
        out.append(order + [("B", k) for k in range(m - warm, m)])
    return out


def simulate(stages: int, m: int, schedule: str = "1f1b", t_forward=1.0, t_backward=2.0) -> list[dict]:
    """The schedule's timeline: each stage runs its passes in `orders`, each as soon as the stage is free and the
    previous stage's forward (or the next stage's backward) of that micro-batch is done. `t_forward`/`t_backward`:
    one time for every stage, or a list of one per stage (stages of unequal cost). Returns events {stage, kind,
    micro, start, end} in the order they were placed."""
    p = stages
    per_stage = lambda t: list(t) if isinstance(t, (list, tuple)) else [t] * p  # noqa: E731
    t_f, t_b = per_stage(t_forward), per_stage(t_backward)
    order = orders(p, m, schedule)
    done: dict[tuple, float] = {}
    free, pos, events = [0.0] * p, [0] * p, []
    while any(pos[i] < len(order[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            if pos[i] >= len(order[i]):
                continue
            kind, k = order[i][pos[i]]
            dep = ("F", i - 1, k) if kind == "F" and i > 0 else ("B", i + 1, k) if kind == "B" and i < p - 1 \
                else ("F", i, k) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[i], done.get(dep, 0.0))
            end = start + (t_f[i] if kind == "F" else t_b[i])
            done[(kind, i, k)] = free[i] = end
            pos[i] += 1
            events.append({"stage": i, "kind": kind, "micro": k, "start": start, "end": end})
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # cannot happen for gpipe / 1f1b
    return events


def programs(schedule: str, m: int, stages: int = 2) -> dict[int, list[tuple[str, int]]]:
    """Per stage, its actions in order: F/B (compute), send_act/recv_act, send_grad/recv_grad, with micro-batch j.
    The simulated timeline (`simulate`, unit forwards, backwards twice as long) as one sequence: passes by start
    time (ties by stage), each preceded by the transfer of its input; each stage keeps its own actions."""
    events = sorted(simulate(stages, m, schedule), key=lambda e: (e["start"], e["stage"]))
    out: dict[int, list[tuple[str, int]]] = {i: [] for i in range(stages)}
    for e in events:
        i, j = e["stage"], e["micro"]
        if e["kind"] == "F" and i > 0:  # the activations of j from the stage before
            out[i - 1].append(("send_act", j))
            out[i].append(("recv_act", j))
        if e["kind"] == "B" and i < stages - 1:  # the gradient of this stage's output from the stage after
            out[i + 1].append(("send_grad", j))
            out[i].append(("recv_grad", j))
        out[i].append((e["kind"], j))
    return out


def transfers(program: list, boundary: int) -> list[tuple[str, int]]:
    """The transfers of a stage's program across one boundary (0: with the stage before, 1: with the stage after),
    in order: the two stages of a boundary must list the same ones."""
    side = {("send_act", 1): "act", ("recv_act", 0): "act", ("send_grad", 0): "grad", ("recv_grad", 1): "grad"}
    return [(side[(a, boundary)], j) for a, j in program if (a, boundary) in side]


def pipeline_step(w, micro_batches: list) -> dict:
    """One optimizer step of worker `w` (labkit.byhand.worker.Worker) as its pipeline stage, over its data-parallel
    share of micro-batches (token ids [b, s+1] each): its loss and gradient norm, and under "stage" its
    `StageStep`. The transfers run on w.groups["pp_prev"] (this stage and the one before) and ["pp_next"]."""
    import mindspore as ms
    from mindspore import ops

    p, stage = w.layout.pp, w.place.pp
    first, last = stage == 0, stage == p - 1
    parts, count = w.batch(micro_batches)  # every stage has the batch: the loss is over the global tokens
    weights = [w.params[n] for n in w.names]
    dtype = weights[0].dtype
    shape = w.boundary_shape(*parts[0][0].shape)
    prev, nxt = w.groups["pp_prev"], w.groups["pp_next"]
    held, arrived, out, acc, loss = {}, {}, {}, None, 0.0

    def forward(j, x):  # the last stage's: its share of the global loss (Worker.loss); the others' output
        _, labels, mask = parts[j]
        return w.loss(w.params, x, labels, mask, count) if last else scratch.stage(w.params, x, mask, w.cfg, w.shard,
                                                                                     w.hooks)

    def backward(j):  # the forward again, under autodiff, then its backward; the input's gradient goes back
        x = held.pop(j)
        seed = ms.Tensor(1.0, dtype) if last else arrived.pop(("grad", j))
        if first:  # token ids: no gradient to send, only the weights'
            _, vjp = ms.vjp(lambda dummy: forward(j, x), ops.zeros((1,), dtype), weights=weights)
        else:
            _, vjp = ms.vjp(lambda x_: forward(j, x_), x, weights=weights)
        g_in, g_w = vjp(seed)
        if not first:
            out[("grad", j)] = g_in[0] if isinstance(g_in, tuple) else g_in
        return g_w

    timeline, peak, t_start = [], 0, time.perf_counter()
    for action, j in programs(w.layout.schedule, len(parts), p)[stage]:
        t0 = time.perf_counter()
        if action == "F":  # forward only; what the backward needs later is this stage's input, kept in `held`
            held[j] = parts[j][0] if first else arrived.pop(("act", j))
            y = forward(j, held[j])
            if last:
                loss += float(y.asnumpy())
            else:
                out[("act", j)] = y
        elif action == "B":
            g_w = backward(j)
            acc = w.optimizer.add(acc, g_w)
        elif action == "send_act":  # this stage is index 0 of its group with the next one
            nxt.transfer(out.pop(("act", j)), 0, Op.PP_ACTIVATION)
        elif action == "recv_act":
            arrived[("act", j)] = prev.transfer(ops.zeros(shape, dtype), 0, Op.PP_ACTIVATION)
        elif action == "send_grad":  # this stage is index 1 of its group with the previous one
            prev.transfer(out.pop(("grad", j)), 1, Op.PP_GRADIENT)
        elif action == "recv_grad":
            arrived[("grad", j)] = nxt.transfer(ops.zeros(shape, dtype), 1, Op.PP_GRADIENT)
        peak = max(peak, len(held))
        timeline.append((action, j, t0 - t_start, time.perf_counter() - t_start))
    loss = sum_over(w.grad_group[0], sum_over(w.groups["pp"], loss, Op.LOSS), Op.LOSS)
    wall = time.perf_counter() - t_start
    busy = sum(t1 - t0 for a, _, t0, t1 in timeline if a in ("F", "B"))
    result = w.optimizer.update(w, acc, loss)
    return {**result, "stage": StageStep(peak, 1 - busy / wall, tuple(timeline))}
