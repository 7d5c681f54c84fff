"""Data parallelism and ZeRO by hand: the optimizers a worker (labkit.byhand.worker.Worker) runs for steps 4-6 of
its step (synchronise the gradients, clip by the global norm, AdamW), one object per kind, each reading the run's
TrainConfig (lr, schedule, AdamW, clipping) as it is:

    AdamW       data, tensor, pipeline and context parallel: whole gradients all-reduced over dp (over
                dp x cp with context parallel), every moment whole
    ZeRO1       ZeRO stage 1 (Rajbhandari et al.): gradients reduce-scattered once at the step, AdamW on this
                worker's 1/dp slice of one flat buffer (`FlatAdamW`), the updated slices all-gathered
    ZeRO2       stage 2: each micro-batch's gradients reduce-scattered at once, a worker keeps only its slice

`Flat` and `Buckets` are the flat, padded buffers the sharded ones slice; MindSpore's optimizer parallel
(labkit.byhand.optimizer_parallel) shares them and `FlatAdamW`. An optimizer's methods take the worker `w` whose
parameters, groups and TrainConfig it updates."""
from __future__ import annotations

import math

import numpy as np

from labkit.byhand.comm import Group, Op, nbytes, sum_over
from labkit.config import TrainConfig
from labkit.training.schedule import lr_at


def adamw(p, g, m, v, lr: float, wd, t: TrainConfig):
    """One AdamW update as `nn.AdamWeightDecay` computes it (no bias correction; decay added to the update):
    m' = b1 m + (1-b1) g,  v' = b2 v + (1-b2) g²,  p' = p - lr (m' / (sqrt(v') + eps) + wd p). Returns (p', m', v')."""
    from mindspore import ops

    m = t.beta1 * m + (1.0 - t.beta1) * g
    v = t.beta2 * v + (1.0 - t.beta2) * ops.square(g)
    return p - lr * (m / (ops.sqrt(v) + t.eps) + wd * p), m, v


def clip_scale(norm: float, t: TrainConfig) -> float:
    """Step 5's factor: min(clip / (norm + 1e-6), 1), or 1 without clipping."""
    return min(t.grad_clip / (norm + 1e-6), 1.0) if t.grad_clip > 0 else 1.0


class WholeGradients:
    """An optimizer that accumulates each micro-batch's whole gradients; `held_grads`: their bytes at the update."""
    held_grads = 0

    def add(self, acc, grads: tuple):
        """The gradients accumulated so far with one micro-batch's (in parameter order)."""
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads))


class AdamW(WholeGradients):
    """Every worker keeps whole gradients and the AdamW moments of all its parameters (data, tensor and pipeline
    parallel): steps 4-6 of labkit.byhand.worker's docstring."""

    def __init__(self, w):
        import mindspore as ms

        self.m = {n: ms.Tensor(np.zeros(w.params[n].shape, w.dtype)) for n in w.names}
        self.v = {n: ms.Tensor(np.zeros(w.params[n].shape, w.dtype)) for n in w.names}
        self.step = 0

    def update(self, w, acc: tuple, loss: float) -> dict:
        """Steps 4-6 on the accumulated gradients of w's parameters; returns the loss and the gradient norm."""
        (dp, summed), tp = w.grad_group, w.groups["tp"]  # dp, or dp x cp under context parallel
        self.held_grads = sum(nbytes(g) for g in acc)
        grads = {n: dp.all_reduce(g, summed) for n, g in zip(w.names, acc)}
        grads = {n: tp.all_reduce(g, Op.SP_NORM_ALL_REDUCE) if w.sp_partial(n) else g for n, g in grads.items()}
        split = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if w.tp_split(n))
        whole = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if not w.tp_split(n))
        sq = sum_over(tp, split, Op.NORM_TP) + whole
        norm = math.sqrt(sum_over(w.groups["pp"], sq, Op.NORM_PP))
        scale = clip_scale(norm, w.train)
        lr = lr_at(self.step, w.train)
        for n in w.names:
            p, self.m[n], self.v[n] = adamw(w.params[n], grads[n] * scale, self.m[n], self.v[n], lr, w.decay[n],
                                            w.train)
            w.params[n].set_data(p)
        self.step += 1
        return {"loss": loss, "grad_norm": norm}

    def state(self) -> dict:
        """The moments by parameter name and the step: what a checkpoint keeps (labkit.byhand.shards)."""
        return {"m": dict(self.m), "v": dict(self.v), "step": self.step}

    def load_state(self, state: dict) -> None:
        self.m, self.v, self.step = dict(state["m"]), dict(state["v"]), int(state["step"])

    def nbytes(self) -> int:
        return sum(nbytes(t) for t in (*self.m.values(), *self.v.values()))


class FlatAdamW:
    """AdamW on this worker's 1/dp slice of flat buffers (`Buckets`), its moments one vector each: steps 5-6 for
    a gradient slice summed over dp. Shared by ZeRO and optimizer parallel (labkit.byhand.optimizer_parallel)."""

    def __init__(self, w, buckets: Buckets):
        import mindspore as ms

        self.buckets, self.train = buckets, w.train
        self.wd = buckets.own({n: ms.Tensor(np.full(w.params[n].shape, w.decay[n], w.dtype)) for n in w.names})
        self.m = ms.Tensor(np.zeros(buckets.size, w.dtype))
        self.v = ms.Tensor(np.zeros(buckets.size, w.dtype))
        self.step = 0

    def update(self, p, g):
        """The global norm from every slice's squares summed over dp (each element counted once), clip, AdamW on
        the slice `p` with its moments. Returns (updated slice, norm)."""
        norm = math.sqrt(sum_over(self.buckets.dp, float((g * g).sum().asnumpy()), Op.NORM_DP))
        p, self.m, self.v = adamw(p, g * clip_scale(norm, self.train), self.m, self.v,
                                  lr_at(self.step, self.train), self.wd, self.train)
        self.step += 1
        return p, norm

    def state(self) -> dict:
        """This worker's slice vectors of the moments (`Buckets`' order) and the step."""
        return {"m": self.m, "v": self.v, "step": self.step}

    def load_state(self, state: dict) -> None:
        self.m, self.v, self.step = state["m"], state["v"], int(state["step"])

    def nbytes(self) -> int:
        return nbytes(self.m) + nbytes(self.v)


class ZeRO1(WholeGradients):
    """ZeRO stage 1 (Rajbhandari et al.): whole gradients accumulated as `AdamW` does, reduce-scattered once at the
    step; this worker updates its 1/dp shard of the flat parameter vector, then all shards are gathered."""

    def __init__(self, w):
        self.buckets = Buckets([w.names], {n: w.params[n].shape for n in w.names}, w.groups["dp"])
        self.flat = FlatAdamW(w, self.buckets)

    def gradient_slice(self, w, acc):
        """This worker's shard of the accumulated gradients summed over dp."""
        self.held_grads = sum(nbytes(g) for g in acc)
        return self.buckets.scatter(self.buckets.pack(dict(zip(w.names, acc))), Op.ZERO1_REDUCE_SCATTER)

    def update(self, w, acc, loss: float) -> dict:
        p, norm = self.flat.update(self.buckets.own(w.params), self.gradient_slice(w, acc))
        for n, value in self.buckets.unpack(0, self.buckets.gather(p, 0, Op.ZERO_ALL_GATHER)).items():
            w.params[n].set_data(value)
        return {"loss": loss, "grad_norm": norm}

    def state(self) -> dict:
        return self.flat.state()

    def load_state(self, state: dict) -> None:
        self.flat.load_state(state)

    def nbytes(self) -> int:
        return self.flat.nbytes()


class ZeRO2(ZeRO1):
    """ZeRO stage 2: as stage 1, but each micro-batch's gradients are reduce-scattered at once, so a worker keeps
    only its 1/dp shard of them."""

    def add(self, acc, grads: tuple):
        g = self.buckets.scatter(self.buckets.pack(dict(zip(self.buckets.names[0], grads))), Op.ZERO2_REDUCE_SCATTER)
        return g if acc is None else acc + g

    def gradient_slice(self, w, acc):
        self.held_grads = nbytes(acc)
        return acc


class Flat:
    """Parameters or gradients as one flat vector, padded to a multiple of the shard count (a sharded buffer)."""

    def __init__(self, shapes: list, shards: int):
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = sum(self.sizes)
        self.padded = -(-self.size // shards) * shards
        self.shard_size = self.padded // shards

    def pack(self, tensors):
        from mindspore import ops

        flat = ops.cat([ops.reshape(t, (-1,)) for t in tensors])
        if self.padded > self.size:
            flat = ops.cat([flat, ops.zeros(self.padded - self.size, flat.dtype)])
        return flat

    def unpack(self, flat) -> list:
        from mindspore import ops

        out, at = [], 0
        for shape, n in zip(self.shapes, self.sizes):
            out.append(ops.reshape(flat[at:at + n], shape))
            at += n
        return out



class Buckets:
    """The parameters in flat buffers (`Flat`), each padded to a multiple of the dp size; the worker of dp index r
    owns the r-th 1/dp slice of every buffer, kept as one vector: its slices one after another (`size` elements).
    ZeRO uses one buffer of every parameter; optimizer parallel one per unit it gathers at once
    (labkit.byhand.optimizer_parallel.units)."""

    def __init__(self, names: list[list[str]], shapes: dict, dp: Group):
        self.names, self.dp = names, dp
        self.flats = [Flat([shapes[n] for n in group], dp.size) for group in names]
        self.starts = [0]
        for flat in self.flats:
            self.starts.append(self.starts[-1] + flat.shard_size)
        self.size = self.starts[-1]

    def pack(self, tensors: dict) -> list:
        """Full tensors by name -> one padded flat vector per buffer."""
        return [flat.pack([tensors[n] for n in group]) for group, flat in zip(self.names, self.flats)]

    def own(self, tensors: dict):
        """Full tensors by name -> this worker's slice vector."""
        from mindspore import ops

        i = self.dp.index
        return ops.cat([full[i * f.shard_size:(i + 1) * f.shard_size]
                        for full, f in zip(self.pack(tensors), self.flats)])

    def gather(self, mine, b: int, name: Op):
        """Buffer b's full padded flat vector, all-gathered from every worker's slice (`mine`: a slice vector)."""
        return self.dp.all_gather(mine[self.starts[b]:self.starts[b + 1]], 0, name)

    def unpack(self, b: int, flat) -> dict:
        return dict(zip(self.names[b], self.flats[b].unpack(flat)))

    def scatter(self, flats: list, name: Op):
        """One padded flat vector per buffer (this worker's gradients) -> this worker's slice vector of their sum
        over dp: a reduce-scatter per buffer."""
        from mindspore import ops

        return ops.cat([self.dp.reduce_scatter(f, 0, name) for f in flats])
