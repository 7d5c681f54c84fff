"""Training the hand-written Llama (labkit.model.scratch) with every parallel dimension done by hand, on msrun CPU
workers, with the trainer's step: the token-mean cross-entropy, global-norm clipping, AdamW with weight decay on the
matrices, the warmup-cosine schedule.

A `HandLayout` places rank = (dp_index * pp + pp_index) * tp + tp_index (tensor parallel innermost, as Megatron does).
One optimizer step, whatever the layout:

    1. read this worker's part of the global batch (the loader's order contract: every layout sees the same samples)
    2. loss = (sum of token cross-entropies) / (tokens in the global batch): summing the workers' gradients of it
       gives the gradient of the global loss exactly, whatever the split
    3. forward and backward; TP/SP collectives run inside the model (labkit.parallel.collectives)
    4. synchronise gradients: data parallel sums them over dp (ZeRO: reduce-scatter, each keeps its shard);
       sequence parallel sums the norms' gradients over tp (each worker saw its part of the sequence)
    5. global norm = sqrt of the squares summed once per element (tp-split, stage, ZeRO shards add up; replicated
       copies count once), clip factor min(clip / (norm + 1e-6), 1)
    6. AdamW on what this worker owns; ZeRO all-gathers the updated parameter shards
Steps 4-6 (and how micro-batches' gradients add up) are the worker's optimizer, one object per kind: `AdamW` (every
moment whole), `ZeRO1` and `ZeRO2` (AdamW on this worker's slice of one flat buffer, `FlatAdamW`, which optimizer
parallel shares); each reads the run's TrainConfig (lr, schedule, AdamW, clipping) as it is.
Pipeline layouts run `labkit.training.pipeline` for step 3; MindSpore's optimizer parallel (a worker that keeps only
its 1/dp slice of the weights) is `labkit.training.optimizer_parallel`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from labkit.config import ModelConfig, TrainConfig
from labkit.errors import LabkitError
from labkit.model import scratch
from labkit.parallel.collectives import Group, Op, SequenceParallel, TensorParallel, nbytes
from labkit.training.schedule import lr_at

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Place:
    """Where a rank sits in its layout's grid: its data-parallel, pipeline-stage and tensor-parallel index, and
    how many stages there are (to name its stage)."""
    dp: int
    pp: int
    tp: int
    stages: int = 1

    @property
    def stage(self) -> str:
        """The stage's name in the planner's words (labkit.parallel.memory.stage_weights): only, first or last."""
        return "only" if self.stages == 1 else "first" if self.pp == 0 else "last"


@dataclass(frozen=True)
class Held:
    """Bytes a worker keeps (`Worker.bytes_held`), per term of the planner's lines: parameters, gradients (as kept
    until the update), AdamW states, and for optimizer parallel the peak of gathered weights (None elsewhere)."""
    params: int
    grads: int
    optimizer: int
    gathered: int | None = None

    def terms(self) -> dict[str, int]:
        """The terms this worker has, by name (no "gathered" but for optimizer parallel)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class HandLayout:
    """How one hand-written run spreads over its workers. labkit.layout.Layout describes what a config asks the
    framework (mindformers' parallel_config) to do; this one is what the lab itself runs on CPU workers."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False  # sequence parallel (needs tp > 1)
    vocab: bool = True  # with tp > 1: the embedding and the head split by vocabulary rows (False: whole on each)
    zero: int = 0  # 0: every worker keeps all optimizer states; 1: states sharded over dp; 2: gradients too
    opt_level: int = 0  # MindSpore's optimizer parallel (optimizer_level level1-3): weights sharded too; 0: off
    micro: int = 1  # micro-batches per step: pipeline micro-batches, or accumulation steps elsewhere
    schedule: str = "1f1b"  # pipeline schedule

    @property
    def workers(self) -> int:
        return self.dp * self.tp * self.pp

    def place(self, rank: int) -> Place:
        return Place(rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp, self.pp)

    def check(self, cfg: ModelConfig, global_batch: int) -> None:
        where = f"layout '{self.name}'"
        if self.sp and self.tp < 2:
            raise LabkitError(f"{where}: sequence parallel needs tp >= 2")
        if self.zero and self.opt_level:
            raise LabkitError(f"{where}: zero and opt_level are two ways of sharding over dp",
                              "choose one: zero (Megatron/DeepSpeed's ZeRO) or opt_level (MindSpore's optimizer "
                              "parallel)")
        if (self.zero or self.opt_level) and (self.tp > 1 or self.pp > 1):
            kind = "ZeRO" if self.zero else "optimizer parallel"
            raise LabkitError(f"{where}: {kind} is written here for pure data parallel",
                              f"use tp = pp = 1 with {'zero' if self.zero else 'opt_level'}")
        if self.zero not in (0, 1, 2) or self.opt_level not in (0, 1, 2, 3) or self.schedule not in SCHEDULES:
            raise LabkitError(f"{where}: zero must be 0, 1 or 2, opt_level 0 to 3 and schedule one of "
                              f"{', '.join(SCHEDULES)}")
        if self.pp not in (1, 2):
            raise LabkitError(f"{where}: pipeline stages are written for pp = 2", "use pp 1 or 2")
        if self.pp > 1 and (self.dp > 1 or self.tp > 1):
            raise LabkitError(f"{where}: the pipeline here runs alone (pp x dp or pp x tp is not written)")
        if self.pp > cfg.num_layers:
            raise LabkitError(f"{where}: {self.pp} stages for {cfg.num_layers} layers")
        if global_batch % (self.dp * self.micro):
            raise LabkitError(f"{where}: global batch {global_batch} does not split into dp {self.dp} x "
                              f"micro {self.micro}")


def stage_shard(cfg: ModelConfig, layout: HandLayout, rank: int) -> scratch.Shard:
    place = layout.place(rank)
    per = math.ceil(cfg.num_layers / layout.pp)
    return scratch.Shard(first_layer=place.pp * per, end_layer=min(cfg.num_layers, (place.pp + 1) * per),
                         tp_size=layout.tp, tp_rank=place.tp, vocab_parallel=layout.vocab and layout.tp > 1)


# ------------------------------------------------------------------------------------------ AdamW, written out


def adamw(p, g, m, v, lr: float, wd, t: TrainConfig):
    """One AdamW update as `nn.AdamWeightDecay` computes it (no bias correction; decay added to the update):
    m' = b1 m + (1-b1) g,  v' = b2 v + (1-b2) g²,  p' = p - lr (m' / (sqrt(v') + eps) + wd p). Returns (p', m', v')."""
    from mindspore import ops

    m = t.beta1 * m + (1.0 - t.beta1) * g
    v = t.beta2 * v + (1.0 - t.beta2) * ops.square(g)
    return p - lr * (m / (ops.sqrt(v) + t.eps) + wd * p), m, v


def sum_over(group: Group, value: float, name: Op) -> float:
    """A number summed over the group's workers (in float32: the CPU backend's AllReduce has no float64)."""
    import mindspore as ms

    if group.size == 1:
        return value
    return float(group.all_reduce(ms.Tensor(value, ms.float32), name).asnumpy())


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
    parallel): steps 4-6 of the module docstring."""

    def __init__(self, w: Worker):
        import mindspore as ms

        self.m = {n: ms.Tensor(np.zeros(w.params[n].shape, w.dtype)) for n in w.names}
        self.v = {n: ms.Tensor(np.zeros(w.params[n].shape, w.dtype)) for n in w.names}
        self.step = 0

    def update(self, w: Worker, acc: tuple, loss: float) -> dict:
        """Steps 4-6 on the accumulated gradients of w's parameters; returns the loss and the gradient norm."""
        dp, tp = w.groups["dp"], w.groups["tp"]
        self.held_grads = sum(nbytes(g) for g in acc)
        grads = {n: dp.all_reduce(g, Op.DP_ALL_REDUCE) for n, g in zip(w.names, acc)}
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

    def nbytes(self) -> int:
        return sum(nbytes(t) for t in (*self.m.values(), *self.v.values()))


class FlatAdamW:
    """AdamW on this worker's 1/dp slice of flat buffers (`Buckets`), its moments one vector each: steps 5-6 for
    a gradient slice summed over dp. Shared by ZeRO and optimizer parallel (labkit.training.optimizer_parallel)."""

    def __init__(self, w: Worker, buckets: Buckets):
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

    def nbytes(self) -> int:
        return nbytes(self.m) + nbytes(self.v)


class ZeRO1(WholeGradients):
    """ZeRO stage 1 (Rajbhandari et al.): whole gradients accumulated as `AdamW` does, reduce-scattered once at the
    step; this worker updates its 1/dp shard of the flat parameter vector, then all shards are gathered."""

    def __init__(self, w: Worker):
        self.buckets = Buckets([w.names], {n: w.params[n].shape for n in w.names}, w.groups["dp"])
        self.flat = FlatAdamW(w, self.buckets)

    def gradient_slice(self, w: Worker, acc):
        """This worker's shard of the accumulated gradients summed over dp."""
        self.held_grads = sum(nbytes(g) for g in acc)
        return self.buckets.scatter(self.buckets.pack(dict(zip(w.names, acc))), Op.ZERO1_REDUCE_SCATTER)

    def update(self, w: Worker, acc, loss: float) -> dict:
        p, norm = self.flat.update(self.buckets.own(w.params), self.gradient_slice(w, acc))
        for n, value in self.buckets.unpack(0, self.buckets.gather(p, 0, Op.ZERO_ALL_GATHER)).items():
            w.params[n].set_data(value)
        return {"loss": loss, "grad_norm": norm}

    def nbytes(self) -> int:
        return self.flat.nbytes()


class ZeRO2(ZeRO1):
    """ZeRO stage 2: as stage 1, but each micro-batch's gradients are reduce-scattered at once, so a worker keeps
    only its 1/dp shard of them."""

    def add(self, acc, grads: tuple):
        g = self.buckets.scatter(self.buckets.pack(dict(zip(self.buckets.names[0], grads))), Op.ZERO2_REDUCE_SCATTER)
        return g if acc is None else acc + g

    def gradient_slice(self, w: Worker, acc):
        self.held_grads = nbytes(acc)
        return acc


# ------------------------------------------------------------------------------------------ one worker's state


class Worker:
    """One worker's parameters, optimizer (`optimizer`: AdamW, ZeRO1 or ZeRO2 by layout.zero) and groups for a
    layout (all but the pipeline's step); `train` is the run's TrainConfig (lr, schedule, AdamW, clipping)."""

    OPTIMIZERS = {0: AdamW, 1: ZeRO1, 2: ZeRO2}  # by layout.zero

    def __init__(self, cfg: ModelConfig, layout: HandLayout, full: dict, rank: int, groups: dict,
                 train: TrainConfig, dtype=np.float32):
        self.cfg, self.layout, self.rank, self.groups, self.train, self.dtype = cfg, layout, rank, groups, train, dtype
        self.shard = stage_shard(cfg, layout, rank)
        self.params = scratch.parameters(full, cfg, self.shard, dtype)
        self.names = list(self.params)
        tp = groups["tp"]
        self.hooks = ((SequenceParallel if layout.sp else TensorParallel)(tp, layout.vocab) if layout.tp > 1
                      else scratch.Hooks())
        self.decay = {n: (train.weight_decay if len(self.params[n].shape) > 1 else 0.0) for n in self.names}
        self.optimizer = self.make_optimizer()

    def make_optimizer(self):
        return self.OPTIMIZERS[self.layout.zero](self)

    # which parameters are split over tp (their square sums add over tp) and which the SP norms are
    def tp_split(self, name: str) -> bool:
        return self.shard.splits(name)

    def sp_partial(self, name: str) -> bool:
        return self.layout.sp and name.endswith(("attention_norm.weight", "ffn_norm.weight"))

    def loss(self, params: dict, tokens, labels, mask, count):
        """This micro-batch's share of the global loss: its summed token cross-entropies over the global count."""
        out = scratch.stage(params, tokens, mask, self.cfg, self.shard, self.hooks)
        return scratch.loss_terms(out, labels, mask, self.hooks)[0] / count

    def batch(self, micro_batches: list) -> tuple[list, object]:
        """(inputs, labels, mask) per micro-batch (token ids [b, s+1] each) and the tokens of the global batch."""
        import mindspore as ms

        parts = [scratch.split_batch(ids, self.cfg.pad_token_id) for ids in micro_batches]
        count = ms.Tensor(sum(float(m.asnumpy().sum()) for _, _, m in parts), ms.float32)
        return parts, self.groups["dp"].all_reduce(count, Op.COUNT)

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over this worker's micro-batches (token ids [b, s+1] each); returns loss and norm."""
        import mindspore as ms

        parts, count = self.batch(micro_batches)
        weights = [self.params[n] for n in self.names]
        acc, loss = None, 0.0
        for tokens, labels, mask in parts:
            value, grads = ms.value_and_grad(lambda: self.loss(self.params, tokens, labels, mask, count), None,
                                             weights)()
            loss += float(value.asnumpy())
            acc = self.optimizer.add(acc, grads)
        return self.optimizer.update(self, acc, sum_over(self.groups["dp"], loss, Op.LOSS))

    def bytes_held(self) -> Held:
        """What this worker keeps between steps: parameters, gradients (as kept until the update), AdamW states."""
        return Held(sum(nbytes(p) for p in self.params.values()), self.optimizer.held_grads,
                    self.optimizer.nbytes())

    def weights(self) -> dict:
        return {n: p.asnumpy() for n, p in self.params.items()}


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
    (labkit.training.optimizer_parallel.units)."""

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
        return ops.cat([full[i * f.shard_size:(i + 1) * f.shard_size] for full, f in zip(self.pack(tensors), self.flats)])

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
