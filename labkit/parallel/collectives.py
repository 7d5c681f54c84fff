"""The collectives a hand-written parallel layout needs, each with its backward, from what MindSpore's CPU backend
runs (2.9: AllReduce, AllGather and Broadcast; Broadcast only on the world group; no ReduceScatter, no Send/Receive).

    copy_in      forward identity,                  backward all-reduce      (Megatron's f: enter a TP block)
    reduce_out   forward all-reduce,                backward identity        (Megatron's g: leave a TP block)
    gather_seq   forward all-gather of the sequence, backward reduce-scatter (SP: enter a TP block)
    scatter_seq  forward reduce-scatter,            backward all-gather      (SP: leave a TP block)
    split_seq    forward keep my sequence chunk,    backward all-gather      (SP: after the embedding)
    unsplit_seq  forward all-gather of the sequence, backward keep my chunk  (SP: before a replicated head)

and, for a vocabulary-parallel embedding and head (`VocabParallel`): the partial lookups' all-reduce, the head
input's f, and the cross-entropy from logit slices (`vocab_parallel_cross_entropy`). The CPU backend's AllReduce
sums only ("AllReduce only support reduce sum on CPU, but got max") and its AllGather runs on the world group only:
the rows' maximum is the maximum over every worker's row maxima, gathered as a sum in which each worker fills its
own slot of a [t, n] tensor of zeros (`stack_by_sum`: exact, the same value an all-reduce MAX gives).

A reduce-scatter is an all-reduce followed by keeping one's own slice (the CPU backend has no ReduceScatter): the
same result, but every worker holds the whole tensor for a moment and the wire carries an all-reduce's bytes.
`Traffic` counts both: what this stand-in sent and what Ascend's HCCL would send for the real operation.
A stage-to-stage transfer (`transfer`) is a broadcast from the sender on the world group, elsewhere an all-reduce
to which the receiver contributes zeros.

Bytes are counted per worker with the ring algorithm's volumes (p workers, n bytes of the full tensor):
all-reduce 2(p-1)/p·n, all-gather and reduce-scatter (p-1)/p·n, broadcast from the root n (to one peer).
Every counted operation has a name of `Op`, in one dimension of `DIMENSIONS` (what the comparison with the
textbook groups by); `Traffic` refuses any other name."""
from __future__ import annotations

import enum
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.errors import LabkitError
from labkit.model.scratch import Hooks

SEQ = 1  # the sequence axis of [batch, seq, hidden]


class Op(enum.StrEnum):
    """The name of every collective a worker records (`Traffic`), as written to its result file."""
    TP_ALL_REDUCE_FWD = "tp_all_reduce_fwd"  # Megatron's g: leave a TP block
    TP_ALL_REDUCE_BWD = "tp_all_reduce_bwd"  # Megatron's f's backward: enter a TP block
    SP_ALL_GATHER_FWD = "sp_all_gather_fwd"
    SP_ALL_GATHER_BWD = "sp_all_gather_bwd"
    SP_REDUCE_SCATTER_FWD = "sp_reduce_scatter_fwd"
    SP_REDUCE_SCATTER_BWD = "sp_reduce_scatter_bwd"
    SP_SPLIT_BWD = "sp_split_bwd"  # after the embedding: the sequence chunks' gradients gathered
    SP_UNSPLIT_FWD = "sp_unsplit_fwd"  # before a replicated head: the sequence gathered
    SP_NORM_ALL_REDUCE = "sp_norm_all_reduce"  # the norms' gradients, each worker's from its part of the sequence
    DP_ALL_REDUCE = "dp_all_reduce"
    ZERO1_REDUCE_SCATTER = "zero1_reduce_scatter"
    ZERO2_REDUCE_SCATTER = "zero2_reduce_scatter"
    ZERO_ALL_GATHER = "zero_all_gather"
    OPT_ALL_GATHER = "opt_all_gather"
    OPT_REGATHER = "opt_regather"  # level3: the weights gathered again for the backward
    OPT_REDUCE_SCATTER = "opt_reduce_scatter"
    OPT_GATHER_TO_SAVE = "opt_gather_to_save"  # after training: the full weights, to save them
    PP_ACTIVATION = "pp_activation"
    PP_GRADIENT = "pp_gradient"
    VOCAB_EMBED_ALL_REDUCE_FWD = "vocab_embed_all_reduce_fwd"
    VOCAB_HEAD_ALL_REDUCE_BWD = "vocab_head_all_reduce_bwd"
    VOCAB_MAX_ALL_GATHER = "vocab_max_all_gather"
    VOCAB_CE_ALL_REDUCE = "vocab_ce_all_reduce"
    COUNT = "count"  # the global batch's tokens, summed over dp
    LOSS = "loss"  # the step's loss, summed over dp or pp
    NORM_TP = "norm_tp"  # the gradient norm's square sums, over each group
    NORM_PP = "norm_pp"
    NORM_DP = "norm_dp"


class Dimension(NamedTuple):
    """One parallel dimension's operations: those whose bytes the textbook's volume for the dimension counts
    (labkit.course.parallel_lab.textbook_bytes), and those recorded beside them that it leaves out."""
    textbook: tuple[Op, ...]
    beside: tuple[Op, ...] = ()


# Every Op in exactly one dimension (a test checks it): the comparison groups what a run recorded by these.
DIMENSIONS = {
    "tp": Dimension((Op.TP_ALL_REDUCE_FWD, Op.TP_ALL_REDUCE_BWD)),
    "sp": Dimension((Op.SP_ALL_GATHER_FWD, Op.SP_ALL_GATHER_BWD, Op.SP_REDUCE_SCATTER_FWD, Op.SP_REDUCE_SCATTER_BWD),
                    (Op.SP_SPLIT_BWD, Op.SP_UNSPLIT_FWD, Op.SP_NORM_ALL_REDUCE)),
    "dp": Dimension((Op.DP_ALL_REDUCE,)),
    "zero": Dimension((Op.ZERO1_REDUCE_SCATTER, Op.ZERO2_REDUCE_SCATTER, Op.ZERO_ALL_GATHER)),
    "opt": Dimension((Op.OPT_ALL_GATHER, Op.OPT_REGATHER, Op.OPT_REDUCE_SCATTER), (Op.OPT_GATHER_TO_SAVE,)),
    "pp": Dimension((Op.PP_ACTIVATION, Op.PP_GRADIENT)),
    "vocab": Dimension((Op.VOCAB_EMBED_ALL_REDUCE_FWD, Op.VOCAB_HEAD_ALL_REDUCE_BWD, Op.VOCAB_MAX_ALL_GATHER,
                        Op.VOCAB_CE_ALL_REDUCE)),
    "scalars": Dimension((), (Op.COUNT, Op.LOSS, Op.NORM_TP, Op.NORM_PP, Op.NORM_DP)),  # a few bytes a step
}


def op_named(name: str, where: str = "") -> Op:
    """The Op of a recorded name; a LabkitError naming it (and `where` it was read) when there is none."""
    try:
        return Op(name)
    except ValueError:
        raise LabkitError(f"'{name}'{' in ' + where if where else ''} is not a collective the lab records",
                          "add it to labkit.parallel.collectives.Op and to its dimension in DIMENSIONS") from None


class Sent(NamedTuple):
    """One operation's count: calls, bytes this worker sent (as run here), bytes the real collective sends."""
    calls: int
    sent_bytes: float
    ideal_bytes: float


@dataclass
class Traffic:
    """Per operation (`Op`): calls, bytes this worker sent (as run here) and bytes the real collective sends."""
    calls: dict = field(default_factory=lambda: defaultdict(int))
    sent: dict = field(default_factory=lambda: defaultdict(float))
    ideal: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, name: Op | str, sent: float, ideal: float | None = None) -> None:
        """Count one call of `name` (an `Op`: any other name is a LabkitError, not a row the comparison drops)."""
        name = op_named(name)
        self.calls[name] += 1
        self.sent[name] += sent
        self.ideal[name] += sent if ideal is None else ideal

    def counts(self) -> dict[Op, Sent]:
        """What was counted so far, per operation (in name order)."""
        return {k: Sent(self.calls[k], self.sent[k], self.ideal[k]) for k in sorted(self.calls)}


def io_bytes() -> int:
    """Bytes this process has passed to read and write system calls so far (/proc/self/io rchar + wchar): what its
    collectives really moved through their sockets, both directions, with whatever the transport adds."""
    from pathlib import Path

    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return int(fields.get("rchar", 0)) + int(fields.get("wchar", 0))


def nbytes(x) -> int:
    return int(x.size) * x.itemsize


@dataclass
class Group:
    """A set of workers that reduce together: its MindSpore group name, its size and this worker's index in it."""
    name: str
    size: int
    index: int
    ranks: tuple = ()
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self):
        self._ops = {}

    def op(self, kind: str):
        if kind not in self._ops:
            from mindspore import ops

            self._ops[kind] = {"all_reduce": lambda: ops.AllReduce(group=self.name),
                               "all_gather": lambda: ops.AllGather(group=self.name)}[kind]()
        return self._ops[kind]

    # ---------------------------------------------------------------- forward-only operations, counted
    def all_reduce(self, x, name: Op):
        if self.size == 1:
            return x
        self.traffic.add(name, 2 * (self.size - 1) / self.size * nbytes(x))
        return self.op("all_reduce")(x)

    def all_gather(self, x, axis: int, name: Op):
        """Concatenate every worker's x along `axis` (in group order)."""
        if self.size == 1:
            return x
        from mindspore import ops

        self.traffic.add(name, (self.size - 1) * nbytes(x))
        if axis == 0:
            return self.op("all_gather")(x)
        perm = _swap(x.ndim, axis)
        return ops.transpose(self.op("all_gather")(ops.transpose(x, perm)), perm)

    def stack_by_sum(self, x, name: Op):
        """[size, *x.shape]: every worker's x in group order, on any group (the CPU backend's AllGather runs on the
        world group only): an all-reduce where each worker fills its own slot with x and the others with zeros, so
        every sum is one x plus zeros, exact. Counted as sent: the all-reduce; ideal: an all-gather of x."""
        from mindspore import ops

        if self.size == 1:
            return ops.expand_dims(x, 0)
        n = nbytes(x)
        self.traffic.add(name, 2 * (self.size - 1) * n, (self.size - 1) * n)
        return self.op("all_reduce")(ops.stack([x if i == self.index else ops.zeros_like(x) for i in range(self.size)]))

    def reduce_scatter(self, x, axis: int, name: Op):
        """The sum over workers, of which this worker keeps its 1/size slice along `axis` (all-reduce + slice)."""
        if self.size == 1:
            return x
        n = nbytes(x)
        self.traffic.add(name, 2 * (self.size - 1) / self.size * n, (self.size - 1) / self.size * n)
        return chunk(self.op("all_reduce")(x), axis, self.size, self.index)

    def transfer(self, x, src: int, world: bool, name: Op):
        """x of worker `src` (an index in this group) delivered to every worker of the group; the others pass a
        tensor of the same shape and dtype (its values are not used)."""
        from mindspore import ops

        if world:
            self.traffic.add(name, nbytes(x) if self.index == src else 0.0)
            return ops.Broadcast(src, group=self.name)((x,))[0]
        mine = x if self.index == src else ops.zeros_like(x)
        self.traffic.add(name, 2 * (self.size - 1) / self.size * nbytes(x), nbytes(x) if self.index == src else 0.0)
        return self.op("all_reduce")(mine)


def _swap(ndim: int, axis: int) -> tuple:
    perm = list(range(ndim))
    perm[0], perm[axis] = axis, 0
    return tuple(perm)


def chunk(x, axis: int, parts: int, index: int):
    """The index-th of `parts` equal slices of x along axis."""
    k = x.shape[axis] // parts
    sl = [slice(None)] * x.ndim
    sl[axis] = slice(index * k, (index + 1) * k)
    return x[tuple(sl)]


PROTOCOL = ("forward", "backward", "apply", "save_for_backward")  # what `differentiable` uses of _Function


@functools.cache
def function_base():
    """MindSpore's private `mindspore.common._Function` (2.9: PyTorch's autograd.Function protocol: static
    forward(ctx, *inputs) and backward(ctx, *grads), `apply`, ctx.save_for_backward / saved_tensors), checked once
    per process; a LabkitError naming the MindSpore version and what changed when it is gone or differs."""
    import mindspore
    import mindspore.common

    base = getattr(mindspore.common, "_Function", None)
    fix = ("labkit.parallel.collectives.differentiable is built on it: pin mindspore==2.9.* (pyproject.toml), "
           "or port `differentiable` to what replaced it")
    if not isinstance(base, type):
        raise LabkitError(f"MindSpore {mindspore.__version__} has no class mindspore.common._Function", fix)
    missing = [name for name in PROTOCOL if not callable(getattr(base, name, None))]
    if missing:
        raise LabkitError(f"MindSpore {mindspore.__version__}'s mindspore.common._Function lacks "
                          f"{', '.join(missing)} (2.9's has {', '.join(PROTOCOL)})", fix)
    return base


def differentiable(forward, backward, saves: bool = False):
    """A differentiable operation from its forward and hand-written backward: the one subclass of MindSpore's
    `_Function` (`function_base`), made once per pair; returns its `apply`.

    Plain: forward(x) -> y, backward(dy) -> dx, and nothing of the forward is kept for the backward. With `saves`:
    forward(x, *more) -> (y, tensors to keep), backward(kept, dy) -> dx; `more` (labels, say) gets no gradient.

    A `Cell` with a custom `bprop` would do, but MindSpore keeps the cell's input and output alive until its
    backward runs, even when `bprop` reads neither (labkit.course.parallel_lab.backward_retention measures it;
    with such cells the hand-written tp2 and sp2 held 26 and 33 MiB more per worker at seq 256). MindSpore 2.9's
    `_Function` (the PyTorch-style autograd function its own recompute is built on, PyNative only) keeps only what
    `ctx.save_for_backward` is given."""

    class Function(function_base()):  # not `Op`: that name is the module's traffic names
        @staticmethod
        def forward(ctx, x, *more):
            ctx.more = len(more)
            if not saves:
                return forward(x, *more)
            y, kept = forward(x, *more)
            ctx.save_for_backward(*kept)
            return y

        @staticmethod
        def backward(ctx, dout):
            dx = backward(ctx.saved_tensors, dout) if saves else backward(dout)
            return (dx, *[None] * ctx.more) if ctx.more else dx  # one gradient per input; none for `more`

    return Function.apply


def cells(group: Group) -> dict:
    """The six differentiable operations of the module docstring, each a forward and a hand-written backward
    (autodiff cannot differentiate AllGather on CPU: its backward would be a ReduceScatter)."""
    return {
        "copy_in": differentiable(lambda x: x, lambda d: group.all_reduce(d, Op.TP_ALL_REDUCE_BWD)),
        "reduce_out": differentiable(lambda x: group.all_reduce(x, Op.TP_ALL_REDUCE_FWD), lambda d: d),
        "gather_seq": differentiable(lambda x: group.all_gather(x, SEQ, Op.SP_ALL_GATHER_FWD),
                                     lambda d: group.reduce_scatter(d, SEQ, Op.SP_REDUCE_SCATTER_BWD)),
        "scatter_seq": differentiable(lambda x: group.reduce_scatter(x, SEQ, Op.SP_REDUCE_SCATTER_FWD),
                                      lambda d: group.all_gather(d, SEQ, Op.SP_ALL_GATHER_BWD)),
        "split_seq": differentiable(lambda x: chunk(x, SEQ, group.size, group.index),
                                    lambda d: group.all_gather(d, SEQ, Op.SP_SPLIT_BWD)),
        "unsplit_seq": differentiable(lambda x: group.all_gather(x, SEQ, Op.SP_UNSPLIT_FWD),
                                      lambda d: chunk(d, SEQ, group.size, group.index)),
    }


def ce_forward(logits, labels, group: Group):
    """Per-token cross-entropy [n] from this worker's logit slice [n, V/t] (vocabulary rows [r·V/t, (r+1)·V/t) of
    group index r) and the labels [n], and what its backward needs (softmax slice, label column, owned mask).

        m = max over every worker's slice (a constant for the gradient: any shift common to the row is exact)
        loss = log(sum_all exp(z - m)) - (z_label - m)     z_label from the worker that owns the label's row
    Two collectives: the row maxima of every worker ([t, n], `Group.stack_by_sum`), one all-reduce of [2, n] (the
    owner's target logit, zero elsewhere, and the slice's sum of exponentials)."""
    from mindspore import ops

    part = logits.shape[-1]
    top = ops.amax(group.stack_by_sum(ops.amax(logits, -1), Op.VOCAB_MAX_ALL_GATHER), 0)
    z = logits - ops.expand_dims(top, -1)
    local = labels - group.index * part
    owned = ops.logical_and(local >= 0, local < part)
    local = ops.where(owned, local, ops.zeros_like(local))
    target = ops.squeeze(ops.gather_elements(z, 1, ops.expand_dims(local, -1)), -1) * owned.astype(z.dtype)
    e = ops.exp(z)
    both = group.all_reduce(ops.stack([target, ops.sum(e, -1)]), Op.VOCAB_CE_ALL_REDUCE)
    return ops.log(both[1]) - both[0], (e / ops.expand_dims(both[1], -1), local, owned)


def ce_backward(saved, dce):
    """The gradient of the logit slice: (softmax - one-hot of the label where this worker owns it) · dloss."""
    from mindspore import ops

    softmax, local, owned = saved
    hot = ops.one_hot(local, softmax.shape[-1], 1.0, 0.0).astype(softmax.dtype)
    return (softmax - hot * ops.expand_dims(owned.astype(softmax.dtype), -1)) * ops.expand_dims(dce, -1)


def vocab_parallel_cross_entropy(group: Group):
    """f(logits [n, V/t], labels [n]) -> per-token cross-entropy [n], differentiable in the logits (Megatron-LM's
    vocab_parallel_cross_entropy): the forward keeps the softmax slice for the backward, nothing else."""
    return differentiable(lambda logits, labels: ce_forward(logits, labels, group), ce_backward, saves=True)


class VocabParallel(Hooks):
    """The vocabulary hooks of a tensor-parallel group, the other hooks one card's (scratch.Hooks): `vocab` = True
    splits the embedding and the head by vocabulary rows (Megatron's VocabParallelEmbedding and
    vocab_parallel_cross_entropy), False keeps both whole on every worker."""

    def _vocab(self, group: Group, vocab: bool) -> None:
        if not vocab:
            return
        self.embed_sum = differentiable(lambda x: group.all_reduce(x, Op.VOCAB_EMBED_ALL_REDUCE_FWD), lambda d: d)
        self.head_in = differentiable(lambda x: x, lambda d: group.all_reduce(d, Op.VOCAB_HEAD_ALL_REDUCE_BWD))
        self.cross_entropy = vocab_parallel_cross_entropy(group)


class TensorParallel(VocabParallel):
    """The model's hooks (labkit.model.scratch.Hooks) for Megatron tensor parallelism over `group`."""

    def __init__(self, group: Group, vocab: bool = True):
        c = cells(group)
        self.block_in, self.block_out = c["copy_in"], c["reduce_out"]
        self._vocab(group, vocab)


class SequenceParallel(VocabParallel):
    """The hooks for tensor + sequence parallelism (Korthikanti et al. 2022): the residual stream and the norms are
    split along the sequence; all-gather before each TP block, reduce-scatter after it."""

    def __init__(self, group: Group, vocab: bool = True):
        c = cells(group)
        self.block_in, self.block_out = c["gather_seq"], c["scatter_seq"]
        self.seq_in, self.seq_out = c["split_seq"], c["unsplit_seq"]
        self._vocab(group, vocab)


def make_group(ranks, rank: int, world_size: int, traffic: Traffic | None = None) -> Group:
    """The Group of `ranks` (this worker among them); the whole job is MindSpore's world group, any other set is
    created (every member calls this with the same ranks)."""
    from mindspore.communication import GlobalComm, create_group

    ranks = tuple(sorted(ranks))
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the group {ranks}")
    if len(ranks) == world_size:
        name = GlobalComm.WORLD_COMM_GROUP
    else:
        name = "labkit_" + "_".join(map(str, ranks))
        if len(ranks) > 1:
            create_group(name, list(ranks))
    return Group(name, len(ranks), ranks.index(rank), ranks, traffic if traffic is not None else Traffic())
