"""The communication of the hand-written layouts (labkit.byhand): a `Group` of workers and its collectives, from
what MindSpore's CPU backend runs (2.9: AllReduce, AllGather and Broadcast; Broadcast only on the world group; no
ReduceScatter, no Send/Receive), each counted in `Traffic` under its name (`Op`). The differentiable operations
built on them (each collective with its backward) are labkit.byhand.mappings.

The CPU backend's AllReduce sums only ("AllReduce only support reduce sum on CPU, but got max") and its AllGather
runs on the world group only: `Group.stack_by_sum` gathers on any group as a sum in which each worker fills its
own slot of a [size, ...] tensor of zeros (exact, the same value an all-gather gives); `Group.all_gather` uses it
off the world group.

A reduce-scatter is an all-reduce followed by keeping one's own slice (the CPU backend has no ReduceScatter): the
same result, but every worker holds the whole tensor for a moment and the wire carries an all-reduce's bytes.
`Traffic` counts both: what this stand-in sent and what Ascend's HCCL would send for the real operation.
A stage-to-stage transfer (`transfer`) is a broadcast from the sender on the world group, elsewhere an all-reduce
to which the receiver contributes zeros. A ring step (`shift`: every worker sends to the next at once, ring
attention's point-to-point pass) is `stack_by_sum` keeping the previous worker's slot; an all-to-all (`all_to_all`,
Ulysses' exchange) is an all-gather keeping this worker's slice along the other axis. Both count the stand-in's
bytes as sent and the real operation's as ideal.

Bytes are counted per worker with the ring algorithm's volumes (p workers, n bytes of the full tensor):
all-reduce 2(p-1)/p·n, all-gather and reduce-scatter (p-1)/p·n, broadcast from the root n (to one peer); a ring
step sends this worker's tensor once (n of it), an all-to-all (p-1)/p of this worker's tensor (n: its size).
Every counted operation has a name of `Op`, in one dimension of `DIMENSIONS` (what the comparison with the
textbook groups by); `Traffic` refuses any other name."""
from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.errors import LabkitError


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
    DP_CP_ALL_REDUCE = "dp_cp_all_reduce"  # with context parallel: the gradients summed over the dp x cp group
    CP_RING_FWD = "cp_ring_fwd"  # ring attention: a key/value block passed to the next worker
    CP_RING_BWD = "cp_ring_bwd"  # its backward: the block's gradient passed back to the previous worker
    CP_ALL_TO_ALL_FWD = "cp_all_to_all_fwd"  # Ulysses: q, k, v and the context between sequence and head splits
    CP_ALL_TO_ALL_BWD = "cp_all_to_all_bwd"
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
    "dp": Dimension((Op.DP_ALL_REDUCE, Op.DP_CP_ALL_REDUCE)),
    "cp": Dimension((Op.CP_RING_FWD, Op.CP_RING_BWD, Op.CP_ALL_TO_ALL_FWD, Op.CP_ALL_TO_ALL_BWD)),
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
                          "add it to labkit.byhand.comm.Op and to its dimension in DIMENSIONS") from None


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
    world: bool = False  # the whole job (MindSpore's world group): the CPU backend's Broadcast runs only there

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
        """Concatenate every worker's x along `axis` (in group order). Off the world group, where the CPU backend
        has no AllGather, `stack_by_sum`'s slots joined."""
        if self.size == 1:
            return x
        full, sent = self._gathered(x, axis)
        self.traffic.add(name, sent, (self.size - 1) * nbytes(x))
        return full

    def _gathered(self, x, axis: int):
        """(every worker's x concatenated along axis, bytes this worker sent for it), uncounted: an AllGather on
        the world group, elsewhere `stack_by_sum`'s all-reduce (counted as sent: 2(p-1)·n)."""
        from mindspore import ops

        if not self.world:
            stacked = self._slots(x)
            return ops.cat([stacked[i] for i in range(self.size)], axis), 2 * (self.size - 1) * nbytes(x)
        if axis == 0:
            return self.op("all_gather")(x), (self.size - 1) * nbytes(x)
        perm = _swap(x.ndim, axis)
        return ops.transpose(self.op("all_gather")(ops.transpose(x, perm)), perm), (self.size - 1) * nbytes(x)

    def _slots(self, x):
        from mindspore import ops

        return self.op("all_reduce")(ops.stack([x if i == self.index else ops.zeros_like(x) for i in range(self.size)]))

    def shift(self, x, by: int, name: Op):
        """The x of the worker `by` places before this one (group index - by, modulo the size): every worker sends
        its x `by` places on at once, one step of a ring of point-to-point sends. The CPU backend has no
        Send/Receive: `stack_by_sum`'s all-reduce, keeping that worker's slot. Counted as sent: the all-reduce;
        ideal: x once (one send to one peer)."""
        if self.size == 1:
            return x
        n = nbytes(x)
        self.traffic.add(name, 2 * (self.size - 1) * n, n)
        return self._slots(x)[(self.index - by) % self.size]

    def all_to_all(self, x, split_axis: int, concat_axis: int, name: Op):
        """Worker j's slice `index` of x along split_axis (x cut in `size` equal slices), for every j, concatenated
        along concat_axis in group order: DeepSpeed-Ulysses' exchange. The CPU backend has no AlltoAll: every
        worker's x gathered along concat_axis (`all_gather`), then this worker's slice along split_axis kept.
        Counted as sent: that gather; ideal: an all-to-all, (size - 1)/size of x (each slice but one sent)."""
        if self.size == 1:
            return x
        full, sent = self._gathered(x, concat_axis)
        self.traffic.add(name, sent, (self.size - 1) / self.size * nbytes(x))
        return chunk(full, split_axis, self.size, self.index)

    def stack_by_sum(self, x, name: Op):
        """[size, *x.shape]: every worker's x in group order, on any group (the CPU backend's AllGather runs on the
        world group only): an all-reduce where each worker fills its own slot with x and the others with zeros, so
        every sum is one x plus zeros, exact. Counted as sent: the all-reduce; ideal: an all-gather of x."""
        from mindspore import ops

        if self.size == 1:
            return ops.expand_dims(x, 0)
        n = nbytes(x)
        self.traffic.add(name, 2 * (self.size - 1) * n, (self.size - 1) * n)
        return self._slots(x)

    def reduce_scatter(self, x, axis: int, name: Op):
        """The sum over workers, of which this worker keeps its 1/size slice along `axis` (all-reduce + slice)."""
        if self.size == 1:
            return x
        n = nbytes(x)
        self.traffic.add(name, 2 * (self.size - 1) / self.size * n, (self.size - 1) / self.size * n)
        return chunk(self.op("all_reduce")(x), axis, self.size, self.index)

    def transfer(self, x, src: int, name: Op):
        """x of worker `src` (an index in this group) delivered to every worker of the group; the others pass a
        tensor of the same shape and dtype (its values are not used). A broadcast on the world group, elsewhere an
        all-reduce to which the others contribute zeros."""
        from mindspore import ops

        if self.world:
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


_CREATED: set[str] = set()  # the groups this process has asked MindSpore to create (a name is created once)


def make_group(ranks, rank: int, world_size: int, traffic: Traffic | None = None) -> Group:
    """The Group of `ranks` (this worker among them); the whole job is MindSpore's world group, any other set is
    created once per process (every member calls this with the same ranks, in the same order of groups)."""
    from mindspore.communication import GlobalComm, create_group

    ranks = tuple(sorted(ranks))
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the group {ranks}")
    world = len(ranks) == world_size
    if world:
        name = GlobalComm.WORLD_COMM_GROUP
    else:
        name = "labkit_" + "_".join(map(str, ranks))
        if len(ranks) > 1 and name not in _CREATED:
            create_group(name, list(ranks))
            _CREATED.add(name)
    return Group(name, len(ranks), ranks.index(rank), ranks, traffic if traffic is not None else Traffic(), world)


def sum_over(group: Group, value: float, name: Op) -> float:
    """A number summed over the group's workers (in float32: the CPU backend's AllReduce has no float64)."""
    import mindspore as ms

    if group.size == 1:
        return value
    return float(group.all_reduce(ms.Tensor(value, ms.float32), name).asnumpy())
