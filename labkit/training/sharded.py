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
Pipeline layouts run `labkit.training.pipeline` for step 3; MindSpore's optimizer parallel (a worker that keeps only
its 1/dp slice of the weights) is `labkit.training.optimizer_parallel`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from labkit.config import ModelConfig
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


@dataclass(frozen=True)
class Optim:
    """The tiny CPU config's optimizer (configs/tiny_cpu.yaml), its warmup and decay shortened for runs of a few
    steps; `lr_at` reads lr, min_lr, warmup_steps and decay_steps from it as from a TrainConfig."""
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    decay_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


def adamw(p, g, m, v, lr: float, wd, o: Optim):
    """One AdamW update as `nn.AdamWeightDecay` computes it (no bias correction; decay added to the update):
    m' = b1 m + (1-b1) g,  v' = b2 v + (1-b2) g²,  p' = p - lr (m' / (sqrt(v') + eps) + wd p). Returns (p', m', v')."""
    from mindspore import ops

    m = o.beta1 * m + (1.0 - o.beta1) * g
    v = o.beta2 * v + (1.0 - o.beta2) * ops.square(g)
    return p - lr * (m / (ops.sqrt(v) + o.eps) + wd * p), m, v


# ------------------------------------------------------------------------------------------ one worker's state


class Worker:
    """One worker's parameters, optimizer states and groups for a layout (all but the pipeline's step)."""

    def __init__(self, cfg: ModelConfig, layout: HandLayout, full: dict, rank: int, groups: dict, optim: Optim,
                 dtype=np.float32):
        import mindspore as ms

        self.cfg, self.layout, self.rank, self.groups, self.o = cfg, layout, rank, groups, optim
        self.shard = stage_shard(cfg, layout, rank)
        self.params = scratch.parameters(full, cfg, self.shard, dtype)
        self.names = list(self.params)
        tp = groups["tp"]
        self.hooks = ((SequenceParallel if layout.sp else TensorParallel)(tp, layout.vocab) if layout.tp > 1
                      else scratch.Hooks())
        self.decay = {n: (optim.weight_decay if len(self.params[n].shape) > 1 else 0.0) for n in self.names}
        if layout.zero or layout.opt_level:  # AdamW on this worker's 1/dp slice of the flat buffers only
            self.buckets = Buckets(self.bucket_names(), {n: self.params[n].shape for n in self.names}, groups["dp"])
            self.wd_shard = self.buckets.own({n: ms.Tensor(np.full(self.params[n].shape, self.decay[n], dtype))
                                              for n in self.names})
            self.m = ms.Tensor(np.zeros(self.buckets.size, dtype))
            self.v = ms.Tensor(np.zeros(self.buckets.size, dtype))
        else:
            self.m = {n: ms.Tensor(np.zeros(self.params[n].shape, dtype)) for n in self.names}
            self.v = {n: ms.Tensor(np.zeros(self.params[n].shape, dtype)) for n in self.names}
        self.step = 0
        self.held = {}

    def bucket_names(self) -> list[list[str]]:
        """The parameters of each flat buffer the sharded optimizer slices: ZeRO puts all of them in one."""
        return [self.names]

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

        dp = self.groups["dp"]
        parts, count = self.batch(micro_batches)
        weights = [self.params[n] for n in self.names]
        acc, loss = None, 0.0
        for tokens, labels, mask in parts:
            value, grads = ms.value_and_grad(lambda: self.loss(self.params, tokens, labels, mask, count), None,
                                             weights)()
            loss += float(value.asnumpy())
            if self.layout.zero == 2:  # reduce-scatter now: keep only this worker's shard of the gradients
                grads = self.buckets.scatter(self.buckets.pack(dict(zip(self.names, grads))), Op.ZERO2_REDUCE_SCATTER)
            acc = grads if acc is None else (acc + grads if self.layout.zero == 2 else
                                             tuple(a + g for a, g in zip(acc, grads)))
        loss = self.sum_over(dp, loss, Op.LOSS)
        if self.layout.zero:
            return self._zero_update(acc, loss)
        return self.update({n: g for n, g in zip(self.names, acc)}, loss)

    def update(self, grads: dict, loss: float) -> dict:
        """Steps 4-6 of the module docstring for full (not ZeRO-sharded) gradients of this worker's parameters."""
        dp = self.groups["dp"]
        self.held = {"grads": sum(nbytes(g) for g in grads.values())}
        grads = {n: dp.all_reduce(g, Op.DP_ALL_REDUCE) for n, g in grads.items()}
        tp = self.groups["tp"]
        grads = {n: tp.all_reduce(g, Op.SP_NORM_ALL_REDUCE) if self.sp_partial(n) else g for n, g in grads.items()}
        split = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if self.tp_split(n))
        whole = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if not self.tp_split(n))
        sq = self.sum_over(tp, split, Op.NORM_TP) + whole
        norm = math.sqrt(self.sum_over(self.groups["pp"], sq, Op.NORM_PP))
        scale = self.clip_scale(norm)
        lr = lr_at(self.step, self.o)
        for n in self.names:
            p, self.m[n], self.v[n] = adamw(self.params[n], grads[n] * scale, self.m[n], self.v[n], lr,
                                            self.decay[n], self.o)
            self.params[n].set_data(p)
        self.step += 1
        return {"loss": loss, "grad_norm": norm}

    def sum_over(self, group: Group, value: float, name: Op) -> float:
        import mindspore as ms

        if group.size == 1:
            return value
        return float(group.all_reduce(ms.Tensor(value, ms.float32), name).asnumpy())  # AllReduce has no float64

    def clip_scale(self, norm: float) -> float:
        return min(self.o.grad_clip / (norm + 1e-6), 1.0) if self.o.grad_clip > 0 else 1.0

    def sharded_adamw(self, p, g):
        """Steps 5-6 on this worker's slice `p` of the flat buffers, `g` the gradient slice summed over dp: the
        global norm from every slice's squares summed over dp (each element counted once), clip, AdamW on the
        slice with its moments. Returns (updated slice, norm); shared by ZeRO and optimizer parallel."""
        norm = math.sqrt(self.sum_over(self.groups["dp"], float((g * g).sum().asnumpy()), Op.NORM_DP))
        p, self.m, self.v = adamw(p, g * self.clip_scale(norm), self.m, self.v, lr_at(self.step, self.o),
                                  self.wd_shard, self.o)
        self.step += 1
        return p, norm

    def _zero_update(self, acc, loss: float) -> dict:
        """ZeRO: this worker updates its 1/dp shard of the flat parameter vector, then all shards are gathered."""
        if self.layout.zero == 1:  # the full local gradients were kept; reduce-scatter them once
            self.held = {"grads": sum(nbytes(g) for g in acc)}
            g = self.buckets.scatter(self.buckets.pack(dict(zip(self.names, acc))), Op.ZERO1_REDUCE_SCATTER)
        else:
            self.held = {"grads": nbytes(acc)}
            g = acc
        p, norm = self.sharded_adamw(self.buckets.own(self.params), g)
        for n, value in self.buckets.unpack(0, self.buckets.gather(p, 0, Op.ZERO_ALL_GATHER)).items():
            self.params[n].set_data(value)
        return {"loss": loss, "grad_norm": norm}

    def bytes_held(self) -> Held:
        """What this worker keeps between steps: parameters, gradients (as kept until the update), AdamW states."""
        opt = (nbytes(self.m) + nbytes(self.v) if self.layout.zero else
               sum(nbytes(t) for t in (*self.m.values(), *self.v.values())))
        return Held(sum(nbytes(p) for p in self.params.values()), self.held.get("grads", 0), opt)

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
