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
Pipeline layouts run `labkit.training.pipeline` for step 3."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.model import scratch
from labkit.parallel.collectives import Group, SequenceParallel, TensorParallel, nbytes
from labkit.training.schedule import lr_at

SCHEDULES = ("gpipe", "1f1b")


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
    micro: int = 1  # micro-batches per step: pipeline micro-batches, or accumulation steps elsewhere
    schedule: str = "1f1b"  # pipeline schedule

    @property
    def workers(self) -> int:
        return self.dp * self.tp * self.pp

    def place(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a rank."""
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def check(self, cfg: ModelConfig, global_batch: int) -> None:
        where = f"layout '{self.name}'"
        if self.sp and self.tp < 2:
            raise LabkitError(f"{where}: sequence parallel needs tp >= 2")
        if self.zero and (self.tp > 1 or self.pp > 1):
            raise LabkitError(f"{where}: ZeRO is written here for pure data parallel", "use tp = pp = 1 with zero")
        if self.zero not in (0, 1, 2) or self.schedule not in SCHEDULES:
            raise LabkitError(f"{where}: zero must be 0, 1 or 2 and schedule one of {', '.join(SCHEDULES)}")
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
    _, stage, tp_index = layout.place(rank)
    per = math.ceil(cfg.num_layers / layout.pp)
    return scratch.Shard(first_layer=stage * per, end_layer=min(cfg.num_layers, (stage + 1) * per),
                         tp_size=layout.tp, tp_rank=tp_index, vocab_parallel=layout.vocab and layout.tp > 1)


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
        if layout.zero:
            self.flat = Flat([self.params[n].shape for n in self.names], groups["dp"].size)
            k = self.flat.shard_size
            lo = groups["dp"].index * k
            wd = np.concatenate([np.full(int(np.prod(self.params[n].shape)), self.decay[n], np.float32)
                                 for n in self.names] + [np.zeros(self.flat.padded - self.flat.size, np.float32)])
            self.wd_shard = ms.Tensor(wd[lo:lo + k].astype(dtype))
            self.m = ms.Tensor(np.zeros(k, dtype))
            self.v = ms.Tensor(np.zeros(k, dtype))
        else:
            self.m = {n: ms.Tensor(np.zeros(self.params[n].shape, dtype)) for n in self.names}
            self.v = {n: ms.Tensor(np.zeros(self.params[n].shape, dtype)) for n in self.names}
        self.step = 0
        self.held = {}

    # which parameters are split over tp (their square sums add over tp) and which the SP norms are
    def tp_split(self, name: str) -> bool:
        return self.shard.splits(name)

    def sp_partial(self, name: str) -> bool:
        return self.layout.sp and name.endswith(("attention_norm.weight", "ffn_norm.weight"))

    def loss_fn(self, tokens, labels, mask, count):
        def f():
            out = scratch.stage(self.params, tokens, mask, self.cfg, self.shard, self.hooks)
            return scratch.loss_terms(out, labels, mask, self.hooks)[0] / count
        return f

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over this worker's micro-batches (token ids [b, s+1] each); returns loss and norm."""
        import mindspore as ms

        dp = self.groups["dp"]
        parts = [scratch.split_batch(ids, self.cfg.pad_token_id) for ids in micro_batches]
        count = dp.all_reduce(ms.Tensor(sum(float(m.asnumpy().sum()) for _, _, m in parts), ms.float32), "count")
        weights = [self.params[n] for n in self.names]
        acc, loss = None, 0.0
        for tokens, labels, mask in parts:
            value, grads = ms.value_and_grad(self.loss_fn(tokens, labels, mask, count), None, weights)()
            loss += float(value.asnumpy())
            if self.layout.zero == 2:  # reduce-scatter now: keep only this worker's shard of the gradients
                grads = dp.reduce_scatter(self.flat.pack(grads), 0, "zero2_reduce_scatter")
            acc = grads if acc is None else (acc + grads if self.layout.zero == 2 else
                                             tuple(a + g for a, g in zip(acc, grads)))
        loss = self.sum_over(dp, loss, "loss")
        if self.layout.zero:
            return self._zero_update(acc, loss)
        return self.update({n: g for n, g in zip(self.names, acc)}, loss)

    def update(self, grads: dict, loss: float) -> dict:
        """Steps 4-6 of the module docstring for full (not ZeRO-sharded) gradients of this worker's parameters."""
        dp = self.groups["dp"]
        self.held = {"grads": sum(nbytes(g) for g in grads.values())}
        grads = {n: dp.all_reduce(g, "dp_all_reduce") for n, g in grads.items()}
        tp = self.groups["tp"]
        grads = {n: tp.all_reduce(g, "sp_norm_all_reduce") if self.sp_partial(n) else g for n, g in grads.items()}
        split = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if self.tp_split(n))
        whole = sum(float((g * g).sum().asnumpy()) for n, g in grads.items() if not self.tp_split(n))
        sq = self.sum_over(tp, split, "norm_tp") + whole
        norm = math.sqrt(self.sum_over(self.groups["pp"], sq, "norm_pp"))
        scale = min(self.o.grad_clip / (norm + 1e-6), 1.0) if self.o.grad_clip > 0 else 1.0
        lr = lr_at(self.step, self.o)
        for n in self.names:
            p, self.m[n], self.v[n] = adamw(self.params[n], grads[n] * scale, self.m[n], self.v[n], lr,
                                            self.decay[n], self.o)
            self.params[n].set_data(p)
        self.step += 1
        return {"loss": loss, "grad_norm": norm}

    def sum_over(self, group: Group, value: float, name: str) -> float:
        import mindspore as ms

        if group.size == 1:
            return value
        return float(group.all_reduce(ms.Tensor(value, ms.float32), name).asnumpy())  # AllReduce has no float64

    def _zero_update(self, acc, loss: float) -> dict:
        """ZeRO: this worker updates its 1/dp shard of the flat parameter vector, then all shards are gathered."""
        dp = self.groups["dp"]
        if self.layout.zero == 1:  # the full local gradients were kept; reduce-scatter them once
            self.held = {"grads": sum(nbytes(g) for g in acc)}
            g = dp.reduce_scatter(self.flat.pack(acc), 0, "zero1_reduce_scatter")
        else:
            self.held = {"grads": nbytes(acc)}
            g = acc
        norm = math.sqrt(self.sum_over(dp, float((g * g).sum().asnumpy()), "norm_dp"))
        scale = min(self.o.grad_clip / (norm + 1e-6), 1.0) if self.o.grad_clip > 0 else 1.0
        k = self.flat.shard_size
        p = self.flat.pack([self.params[n] for n in self.names])[dp.index * k:(dp.index + 1) * k]
        p, self.m, self.v = adamw(p, g * scale, self.m, self.v, lr_at(self.step, self.o), self.wd_shard, self.o)
        full = dp.all_gather(p, 0, "zero_all_gather")
        for n, value in zip(self.names, self.flat.unpack(full)):
            self.params[n].set_data(value)
        self.step += 1
        return {"loss": loss, "grad_norm": norm}

    def bytes_held(self) -> dict:
        """What this worker keeps between steps: parameters, gradients (as kept until the update), AdamW states."""
        opt = (nbytes(self.m) + nbytes(self.v) if self.layout.zero else
               sum(nbytes(t) for t in (*self.m.values(), *self.v.values())))
        return {"params": sum(nbytes(p) for p in self.params.values()), "grads": self.held.get("grads", 0),
                "optimizer": opt}

    def weights(self) -> dict:
        return {n: p.asnumpy() for n, p in self.params.items()}


class Flat:
    """Parameters or gradients as one flat vector, padded to a multiple of the shard count (ZeRO's buffer)."""

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

