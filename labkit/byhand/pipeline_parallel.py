"""Pipeline parallelism by hand: 2 stages, m micro-batches, GPipe or 1F1B (Narayanan et al. 2021).

Stage 0 holds the embedding and the first half of the layers, stage 1 the rest, the final norm and the head. For
micro-batch j, stage 0's forward (F j) sends its output activations a_j [b, s, h] to stage 1; stage 1's forward
computes the loss, its backward (B j) sends the gradient g_j of a_j back; stage 0's backward takes g_j. Between its
F j and B j a stage holds micro-batch j: here its stage input, and B j runs the forward again under autodiff before
the backward (full activation recompute, as Megatron does with `recompute_granularity=full`). MindSpore's PyNative
autodiff keeps only the most recent forward open for a backward (an older `ms.vjp` closure fails with "Can not find
top cell for backward"), and 1F1B needs the older one: B0 comes after F1.

    GPipe  stage 0: F0 F1 .. F(m-1)  B0 B1 .. B(m-1)      holds m micro-batches at its peak
    1F1B   stage 0: F0 F1 B0 F2 B1 .. B(m-1)               holds p = 2: one backward after each forward
           stage 1: F0 B0 F1 B1 ..                         holds 1

The transfers are broadcasts on the world group (the CPU backend has no Send/Receive): both stages must call them
in the same order. With 1F1B, stage 0 sends a_(j+1) before it waits for g_j, so stage 1 receives a_(j+1) just before
it sends g_j (a b·s·h input buffer, not activations: nothing is computed on it before F(j+1)).

Each action is timed; the idle share of a stage's step is 1 - (its F and B time) / (its step's wall time), which
the schedule predicts as (p - 1) / (m + p - 1) when every F and B take the same time (the bubble (p - 1) / m of the
ideal time)."""
from __future__ import annotations

import time
from typing import NamedTuple

from labkit.byhand.comm import Op, sum_over
from labkit.model import scratch


class StageStep(NamedTuple):
    """One optimizer step of one stage: the micro-batches it held at once at its peak, its idle share, and its
    timeline, (action, micro-batch, start, end) rows in seconds from the step's start."""
    peak_held_microbatches: int
    idle_share: float
    timeline: tuple[tuple[str, int, float, float], ...]


def programs(schedule: str, m: int) -> dict[int, list[tuple[str, int]]]:
    """Per stage, its actions in order: F/B (compute), send_act/recv_act, send_grad/recv_grad, with micro-batch j."""
    if schedule == "gpipe":
        s0 = [a for j in range(m) for a in (("F", j), ("send_act", j))]
        s0 += [a for j in range(m) for a in (("recv_grad", j), ("B", j))]
        s1 = [a for j in range(m) for a in (("recv_act", j), ("F", j))]
        s1 += [a for j in range(m) for a in (("B", j), ("send_grad", j))]
        return {0: s0, 1: s1}
    s0, s1 = [("F", 0), ("send_act", 0)], [("recv_act", 0)]
    for j in range(m):
        if j + 1 < m:
            s0 += [("F", j + 1), ("send_act", j + 1)]
        s0 += [("recv_grad", j), ("B", j)]
        s1 += [("F", j)] + ([("recv_act", j + 1)] if j + 1 < m else []) + [("B", j), ("send_grad", j)]
    return {0: s0, 1: s1}


def transfers(program: list) -> list[tuple[str, int]]:
    """The order in which a stage takes part in transfers (the same for both stages, by construction)."""
    kind = {"send_act": "act", "recv_act": "act", "send_grad": "grad", "recv_grad": "grad"}
    return [(kind[a], j) for a, j in program if a in kind]


def pipeline_step(w, micro_batches: list) -> dict:
    """One optimizer step of worker `w` (labkit.byhand.worker.Worker) as a pipeline stage: its loss and
    gradient norm, and under "stage" its `StageStep`."""
    import mindspore as ms
    from mindspore import ops


    cfg, pp = w.cfg, w.groups["pp"]
    stage = pp.index
    parts = [scratch.split_batch(ids, cfg.pad_token_id) for ids in micro_batches]
    count = ms.Tensor(sum(float(m.asnumpy().sum()) for _, _, m in parts), ms.float32)  # both stages have the batch
    weights = [w.params[n] for n in w.names]
    b, s = parts[0][0].shape
    dtype = weights[0].dtype
    held, inbox, outbox, grads, loss = {}, {}, {}, None, 0.0

    def forward(j, x):
        _, labels, mask = parts[j]
        out = scratch.stage(w.params, x, mask, cfg, w.shard)
        return out if stage == 0 else scratch.loss_terms(out, labels, mask)[0] / count

    timeline, peak, t_start = [], 0, time.perf_counter()
    for action, j in programs(w.layout.schedule, len(parts))[stage]:
        t0 = time.perf_counter()
        tokens = parts[j][0]
        if action == "F":  # forward only; what the backward needs later is this stage's input, kept in `held`
            held[j] = tokens if stage == 0 else inbox.pop(j)
            out = forward(j, held[j])
            if stage == 0:
                outbox[j] = out
            else:
                loss += float(out.asnumpy())
        elif action == "B":  # the forward again, under autodiff, then its backward
            x = held.pop(j)
            if stage == 0:
                _, vjp = ms.vjp(lambda dummy: forward(j, x), ops.zeros((1,), dtype), weights=weights)
                _, g_w = vjp(inbox.pop(("g", j)))
            else:
                _, vjp = ms.vjp(lambda x_: forward(j, x_), x, weights=weights)
                g_in, g_w = vjp(ms.Tensor(1.0, dtype))
                outbox[("g", j)] = g_in[0] if isinstance(g_in, tuple) else g_in
            grads = list(g_w) if grads is None else [a + g for a, g in zip(grads, g_w)]
        elif action == "send_act":
            pp.transfer(outbox.pop(j), 0, True, Op.PP_ACTIVATION)
        elif action == "recv_act":
            inbox[j] = pp.transfer(ops.zeros((b, s, cfg.hidden_size), dtype), 0, True, Op.PP_ACTIVATION)
        elif action == "send_grad":
            pp.transfer(outbox.pop(("g", j)), 1, True, Op.PP_GRADIENT)
        elif action == "recv_grad":
            inbox[("g", j)] = pp.transfer(ops.zeros((b, s, cfg.hidden_size), dtype), 1, True, Op.PP_GRADIENT)
        peak = max(peak, len(held))
        timeline.append((action, j, t0 - t_start, time.perf_counter() - t_start))
    loss = sum_over(pp, loss, Op.LOSS)
    wall = time.perf_counter() - t_start
    busy = sum(t1 - t0 for a, _, t0, t1 in timeline if a in ("F", "B"))
    result = w.optimizer.update(w, tuple(grads), loss)
    return {**result, "stage": StageStep(peak, 1 - busy / wall, tuple(timeline))}
