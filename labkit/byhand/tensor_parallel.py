"""Tensor, sequence and vocabulary parallelism by hand: the hooks (labkit.model.scratch.Hooks, where the model's
forward calls them) that put the collectives of labkit.byhand.mappings between a worker's slices.

    TensorParallel    Megatron's f and g around each attention and FFN block (copy_in, reduce_out)
    SequenceParallel  Korthikanti et al. 2022: the residual stream split along the sequence, all-gather before each
                      TP block and reduce-scatter after it (gather_seq, scatter_seq; split_seq, unsplit_seq)
    VocabParallel     both with `vocab`: the embedding and the head split by vocabulary rows (Megatron's
                      VocabParallelEmbedding): the partial lookups' all-reduce, the head input's f, and the
                      cross-entropy from logit slices (`vocab_parallel_cross_entropy`)

The CPU backend's AllReduce sums only, so the rows' maximum in the cross-entropy is the maximum over every worker's
row maxima, gathered with `Group.stack_by_sum` (exact, the same value an all-reduce MAX gives)."""
from __future__ import annotations

from labkit.byhand.comm import Group, Op
from labkit.byhand.mappings import copy_in, differentiable, gather_seq, reduce_out, scatter_seq, split_seq, unsplit_seq
from labkit.model.scratch import Hooks


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
        self.block_in, self.block_out = copy_in(group), reduce_out(group)
        self._vocab(group, vocab)


class SequenceParallel(VocabParallel):
    """The hooks for tensor + sequence parallelism (Korthikanti et al. 2022): the residual stream and the norms are
    split along the sequence; all-gather before each TP block, reduce-scatter after it."""

    def __init__(self, group: Group, vocab: bool = True):
        self.block_in, self.block_out = gather_seq(group), scatter_seq(group)
        self.seq_in, self.seq_out = split_seq(group), unsplit_seq(group)
        self._vocab(group, vocab)
