"""Training the hand-written Llama (labkit.model.scratch) with every parallel dimension done by hand, on msrun CPU
workers, with the trainer's step: the token-mean cross-entropy, global-norm clipping, AdamW with weight decay on the
matrices, the warmup-cosine schedule.

A `HandLayout` places rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index: tensor parallel
innermost, as Megatron does, context parallel next to it (Megatron's order tp-cp-ep-dp-pp puts cp next to tp too:
the ring's traffic between neighbouring ranks). One optimizer step, whatever the layout:

    1. read this worker's part of the global batch (the loader's order contract: every layout sees the same samples);
       the cp workers of one dp index read the same rows, each keeps its chunks of the sequence (inputs, labels,
       mask: labkit.byhand.context_parallel)
    2. loss = (sum of token cross-entropies) / (tokens in the global batch): summing the workers' gradients of it
       gives the gradient of the global loss exactly, whatever the split (over dp, and over cp: each worker's sum
       is over its part of the sequence)
    3. forward and backward; TP/SP/CP collectives run inside the model (labkit.byhand.tensor_parallel,
       context_parallel)
    4. synchronise gradients: data parallel sums them over dp, over dp x cp with context parallel (each cp worker's
       gradient is of its tokens' share: one all-reduce over the dp x cp group, as Megatron-LM reduces over its
       data-parallel group with context parallel) (ZeRO: reduce-scatter, each keeps its shard);
       sequence parallel sums the norms' gradients over tp (each worker saw its part of the sequence)
    5. global norm = sqrt of the squares summed once per element (tp-split, stage, ZeRO shards add up; replicated
       copies, over dp and cp, count once), clip factor min(clip / (norm + 1e-6), 1)
    6. AdamW on what this worker owns; ZeRO all-gathers the updated parameter shards
Steps 4-6 (and how micro-batches' gradients add up) are the worker's optimizer, one object per kind
(labkit.byhand.data_parallel): `AdamW` (every moment whole), `ZeRO1` and `ZeRO2` (AdamW on this worker's slice of
one flat buffer, `FlatAdamW`, which optimizer parallel shares); each reads the run's TrainConfig (lr, schedule,
AdamW, clipping) as it is. Pipeline layouts run `labkit.byhand.pipeline_parallel` for step 3; MindSpore's optimizer
parallel (a worker that keeps only its 1/dp slice of the weights) is `labkit.byhand.optimizer_parallel`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from labkit.byhand.comm import Group, Op, nbytes, sum_over
from labkit.byhand.context_parallel import ALGOS, ContextParallel, check_ulysses
from labkit.byhand.data_parallel import AdamW, ZeRO1, ZeRO2
from labkit.byhand.pipeline_parallel import SCHEDULES
from labkit.byhand.tensor_parallel import SequenceParallel, TensorParallel
from labkit.config import ModelConfig, TrainConfig
from labkit.errors import LabkitError
from labkit.model import scratch
from labkit.model.shapes import pipeline_layers


@dataclass(frozen=True)
class Place:
    """Where a rank sits in its layout's grid: its data-parallel, pipeline-stage, tensor-parallel and
    context-parallel index."""
    dp: int
    pp: int
    tp: int
    cp: int = 0


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
    cp: int = 1  # context parallel: each sequence split over cp workers (labkit.byhand.context_parallel)
    cp_algo: str = "ring"  # "ring" (ring attention) or "ulysses" (DeepSpeed-Ulysses' all-to-alls)

    @property
    def workers(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def place(self, rank: int) -> Place:
        tp, cp, pp = self.tp, self.cp, self.pp
        return Place(rank // (pp * cp * tp), rank // (cp * tp) % pp, rank % tp, rank // tp % cp)

    def rank_at(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def members(self, rank: int) -> dict[str, list[int]]:
        """The ranks of each of this rank's groups: tp, cp, dp and pp (the ranks that differ from it in that index
        alone), dp_cp (in either or both: where the gradients are summed), and pp_prev and pp_next (its stage with
        the stage before, and after; alone at the ends)."""
        at = self.place(rank)
        of = lambda dp, pp, tp, cp=at.cp: self.rank_at(dp, pp, tp, cp)  # noqa: E731
        return {"tp": [of(at.dp, at.pp, i) for i in range(self.tp)],
                "cp": [of(at.dp, at.pp, at.tp, i) for i in range(self.cp)],
                "dp": [of(i, at.pp, at.tp) for i in range(self.dp)],
                "dp_cp": [of(i, at.pp, at.tp, j) for i in range(self.dp) for j in range(self.cp)],
                "pp": [of(at.dp, i, at.tp) for i in range(self.pp)],
                "pp_prev": [of(at.dp, i, at.tp) for i in range(max(at.pp - 1, 0), at.pp + 1)],
                "pp_next": [of(at.dp, i, at.tp) for i in range(at.pp, min(at.pp + 2, self.pp))]}

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
        self.check_cp(cfg)
        if self.pp > cfg.num_layers:
            raise LabkitError(f"{where}: {self.pp} stages for {cfg.num_layers} layers", "give every stage a layer")
        if global_batch % (self.dp * self.micro):
            raise LabkitError(f"{where}: global batch {global_batch} does not split into dp {self.dp} x "
                              f"micro {self.micro}")

    def check_cp(self, cfg: ModelConfig) -> None:
        where = f"layout '{self.name}'"
        if self.cp_algo not in ALGOS:
            raise LabkitError(f"{where}: context parallel algorithm '{self.cp_algo}' is not known",
                              f"use cp_algo {' or '.join(ALGOS)}")
        if self.cp == 1:
            return
        if self.sp or self.pp > 1 or self.zero or self.opt_level:
            raise LabkitError(f"{where}: context parallel is written here with data and tensor parallel only",
                              "use cp with dp and tp (no sp, pp, zero or opt_level)")
        if self.cp_algo == "ulysses":  # the heads split by tp first, then by Ulysses' degree
            check_ulysses(cfg.num_heads // self.tp, cfg.kv_heads // self.tp, self.cp, f"{where}: ")


def stage_shard(cfg: ModelConfig, layout: HandLayout, rank: int) -> scratch.Shard:
    place = layout.place(rank)
    layers = pipeline_layers(cfg.num_layers, layout.pp, place.pp)
    return scratch.Shard(first_layer=layers.start, end_layer=layers.stop, tp_size=layout.tp, tp_rank=place.tp,
                         vocab_parallel=layout.vocab and layout.tp > 1)


class Worker:
    """One worker's parameters, optimizer (`optimizer`: AdamW, ZeRO1 or ZeRO2 by layout.zero) and groups for a
    layout (all but the pipeline's step); `train` is the run's TrainConfig (lr, schedule, AdamW, clipping)."""

    OPTIMIZERS = {0: AdamW, 1: ZeRO1, 2: ZeRO2}  # by layout.zero

    def __init__(self, cfg: ModelConfig, layout: HandLayout, full: dict, rank: int, groups: dict,
                 train: TrainConfig, dtype=np.float32):
        self.cfg, self.layout, self.rank, self.groups, self.train, self.dtype = cfg, layout, rank, groups, train, dtype
        self.place, self.shard = layout.place(rank), stage_shard(cfg, layout, rank)
        self.params = scratch.parameters(full, cfg, self.shard, dtype)
        self.names = list(self.params)
        tp = groups["tp"]
        self.hooks = ((SequenceParallel if layout.sp else TensorParallel)(tp, layout.vocab) if layout.tp > 1
                      else scratch.Hooks())
        if layout.cp > 1:
            self.hooks = ContextParallel(groups["cp"], layout.cp_algo, self.hooks)
        self.decay = {n: (train.weight_decay if len(self.params[n].shape) > 1 else 0.0) for n in self.names}
        self.optimizer = self.make_optimizer()

    def make_optimizer(self):
        return self.OPTIMIZERS[self.layout.zero](self)

    # which parameters are split over tp (their square sums add over tp) and which the SP norms are
    def tp_split(self, name: str) -> bool:
        return self.shard.splits(name)

    def sp_partial(self, name: str) -> bool:
        return self.layout.sp and name.endswith(("attention_norm.weight", "ffn_norm.weight"))

    @property
    def grad_group(self) -> tuple[Group, Op]:
        """Where the gradients (and the loss) are summed and under which name: dp, or dp x cp."""
        if self.layout.cp > 1:
            return self.groups["dp_cp"], Op.DP_CP_ALL_REDUCE
        return self.groups["dp"], Op.DP_ALL_REDUCE

    def loss(self, params: dict, tokens, labels, mask, count):
        """This micro-batch's share of the global loss: its summed token cross-entropies over the global count.
        Context parallel: the sequence chunks of this worker (`ContextParallel.take`) of the inputs, labels and
        mask; the whole mask goes to the model, whose frame reads every chunk's padding from it."""
        mine = mask
        if self.layout.cp > 1:
            tokens, labels, mine = (self.hooks.take(t) for t in (tokens, labels, mask))
        out = scratch.stage(params, tokens, mask, self.cfg, self.shard, self.hooks)
        return scratch.loss_terms(out, labels, mine, self.hooks)[0] / count

    def boundary_shape(self, b: int, s: int) -> tuple[int, int, int]:
        """What one pipeline stage sends the next for a micro-batch of b sequences of s tokens: the residual
        stream, split by sequence over tp under sequence parallelism."""
        return b, s // self.layout.tp if self.layout.sp else s, self.cfg.hidden_size

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
        return self.optimizer.update(self, acc, sum_over(self.grad_group[0], loss, Op.LOSS))

    def bytes_held(self) -> Held:
        """What this worker keeps between steps: parameters, gradients (as kept until the update), AdamW states."""
        return Held(sum(nbytes(p) for p in self.params.values()), self.optimizer.held_grads,
                    self.optimizer.nbytes())

    def weights(self) -> dict:
        return {n: p.asnumpy() for n, p in self.params.items()}
