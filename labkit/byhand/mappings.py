"""The collectives with their backward, one named function each (as Megatron-LM's
core/tensor_parallel/mappings.py): given a `Group` (labkit.byhand.comm), each returns a differentiable operation.

    copy_in      forward identity,                  backward all-reduce      (Megatron's f: enter a TP block)
    reduce_out   forward all-reduce,                backward identity        (Megatron's g: leave a TP block)
    gather_seq   forward all-gather of the sequence, backward reduce-scatter (SP: enter a TP block)
    scatter_seq  forward reduce-scatter,            backward all-gather      (SP: leave a TP block)
    split_seq    forward keep my sequence chunk,    backward all-gather      (SP: after the embedding)
    unsplit_seq  forward all-gather of the sequence, backward keep my chunk  (SP: before a replicated head)
    ring_pass    forward pass my block to the next worker, backward its gradient to the previous one
                                                     (CP: ring attention's key/value step)
    seq_to_heads forward all-to-all, sequence split -> head split, backward the reverse  (CP: Ulysses, before
    heads_to_seq forward all-to-all, head split -> sequence split, backward the reverse   attention; after it)

Autodiff cannot differentiate AllGather on CPU (its backward would be a ReduceScatter), so every backward is
written by hand: `differentiable` pairs a forward with its backward on MindSpore's `_Function` (`function_base`).
The vocabulary-parallel pairs (the embedding's all-reduce, the head input's f, the cross-entropy from logit slices)
are in labkit.byhand.tensor_parallel, beside the hooks that use them."""
from __future__ import annotations

import functools

from labkit.byhand.comm import Group, Op, chunk
from labkit.errors import LabkitError

SEQ = 1  # the sequence axis of [batch, seq, hidden]
HEADS, TOKENS = 1, 2  # the head and sequence axes of attention's [batch, heads, seq, head_dim]


PROTOCOL = ("forward", "backward", "apply", "save_for_backward")  # what `differentiable` uses of _Function


@functools.cache
def function_base():
    """MindSpore's private `mindspore.common._Function` (2.9: PyTorch's autograd.Function protocol: static
    forward(ctx, *inputs) and backward(ctx, *grads), `apply`, ctx.save_for_backward / saved_tensors), checked once
    per process; a LabkitError naming the MindSpore version and what changed when it is gone or differs."""
    import mindspore
    import mindspore.common

    base = getattr(mindspore.common, "_Function", None)
    fix = ("labkit.byhand.mappings.differentiable is built on it: pin mindspore==2.9.* (pyproject.toml), "
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

    class Function(function_base()):  # not `Op`: that name is comm's traffic names
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


def copy_in(group: Group):
    """Megatron's f (enter a TP block): forward identity, backward all-reduce."""
    return differentiable(lambda x: x, lambda d: group.all_reduce(d, Op.TP_ALL_REDUCE_BWD))


def reduce_out(group: Group):
    """Megatron's g (leave a TP block): forward all-reduce, backward identity."""
    return differentiable(lambda x: group.all_reduce(x, Op.TP_ALL_REDUCE_FWD), lambda d: d)


def gather_seq(group: Group):
    """SP, enter a TP block: forward all-gather of the sequence, backward reduce-scatter."""
    return differentiable(lambda x: group.all_gather(x, SEQ, Op.SP_ALL_GATHER_FWD),
                          lambda d: group.reduce_scatter(d, SEQ, Op.SP_REDUCE_SCATTER_BWD))


def scatter_seq(group: Group):
    """SP, leave a TP block: forward reduce-scatter of the sequence, backward all-gather."""
    return differentiable(lambda x: group.reduce_scatter(x, SEQ, Op.SP_REDUCE_SCATTER_FWD),
                          lambda d: group.all_gather(d, SEQ, Op.SP_ALL_GATHER_BWD))


def split_seq(group: Group):
    """SP, after the embedding: forward keep this worker's sequence chunk, backward all-gather."""
    return differentiable(lambda x: chunk(x, SEQ, group.size, group.index),
                          lambda d: group.all_gather(d, SEQ, Op.SP_SPLIT_BWD))


def unsplit_seq(group: Group):
    """SP, before a replicated head: forward all-gather of the sequence, backward keep this worker's chunk."""
    return differentiable(lambda x: group.all_gather(x, SEQ, Op.SP_UNSPLIT_FWD),
                          lambda d: chunk(d, SEQ, group.size, group.index))


def ring_pass(group: Group):
    """CP, one step of ring attention (Liu et al. 2023): forward every worker passes its block to the next (gets
    the previous one's), backward the gradient goes back the same way, to the worker the block came from."""
    return differentiable(lambda x: group.shift(x, 1, Op.CP_RING_FWD), lambda d: group.shift(d, -1, Op.CP_RING_BWD))


def seq_to_heads(group: Group):
    """CP, Ulysses (Jacobs et al. 2023) before attention: forward all-to-all from [b, heads, s/cp, d] (this
    worker's tokens, every head) to [b, heads/cp, s, d] (every worker's tokens in group order, this worker's
    heads), backward the reverse all-to-all."""
    return differentiable(lambda x: group.all_to_all(x, HEADS, TOKENS, Op.CP_ALL_TO_ALL_FWD),
                          lambda d: group.all_to_all(d, TOKENS, HEADS, Op.CP_ALL_TO_ALL_BWD))


def heads_to_seq(group: Group):
    """CP, Ulysses after attention: forward all-to-all from [b, heads/cp, s, d] back to [b, heads, s/cp, d],
    backward the reverse all-to-all."""
    return differentiable(lambda x: group.all_to_all(x, TOKENS, HEADS, Op.CP_ALL_TO_ALL_FWD),
                          lambda d: group.all_to_all(d, HEADS, TOKENS, Op.CP_ALL_TO_ALL_BWD))
