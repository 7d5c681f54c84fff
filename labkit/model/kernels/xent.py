"""The softmax cross-entropy over the logits as a MindSpore custom AOT operator (forward and backward in C++), and
the switch that puts it into mindformers' `CrossEntropyLoss` cell.

mindformers computes the per-row loss as a chain of CPU kernels over the whole [N, V] logits (max, sub, exp, sum,
log, sub, one-hot, mul, neg, sum) and, in the backward, exp, sub and mul over [N, V] again. The custom operator
reads each row twice in the forward (max, then the sum of exponentials) and writes the gradient row once in the
backward, recomputing the softmax instead of keeping an [N, V] tensor alive between the passes. The masked mean
over the rows stays mindformers' own: `sum(loss * mask) / (sum(mask) + 1e-8)`. Labels outside [0, V) give loss 0
and gradient softmax * dloss, as mindformers' all-zero one-hot row does. tests/test_kernels.py holds it equal to
the native cell, values and gradients.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build, switch_cells


@functools.lru_cache(maxsize=1)
def xent_op():
    """The forward `ops.Custom` (logits [N, V] float32, labels [N] int32 -> loss [N] float32) with its backward
    attached, or None when no C++ compiler is found."""
    from mindspore import ops

    lib = build("xent")
    if lib is None:
        return None
    backward = ops.Custom(f"{lib}:SoftmaxXentBackward", out_shape=lambda x, t, d: x,
                          out_dtype=lambda x, t, d: x, func_type="aot")
    zeros_like = ops.ZerosLike()

    def bprop(logits, labels, out, dout):
        return backward(logits, labels, dout), zeros_like(labels)

    return ops.Custom(f"{lib}:SoftmaxXentForward", out_shape=lambda x, t: [x[0]], out_dtype=lambda x, t: x,
                      func_type="aot", bprop=bprop)


@functools.lru_cache(maxsize=1)
def custom_cell_class():
    """A `CrossEntropyLoss` subclass: the custom per-row loss, then mindformers' masked mean, unchanged."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.core.loss.loss import CrossEntropyLoss

    class CustomCrossEntropyLoss(CrossEntropyLoss):
        def construct(self, logits, label, input_mask):
            loss_reduce = self.custom_xent(ops.cast(logits, ms.float32), ops.cast(label, ms.int32))
            input_mask = ops.depend(ops.reshape(input_mask, (-1,)), loss_reduce)
            numerator = self.sum2(self.mul2(loss_reduce, input_mask))
            denominator = self.add2(self.sum2(input_mask), self.eps_tensor)
            return self.div2(numerator, denominator)

    return CustomCrossEntropyLoss


def use_custom_cross_entropy(model, log=None) -> int:
    """Switch the model's `CrossEntropyLoss` (mindformers' `loss` attribute) to the custom operator; returns how
    many cells were switched (0, with a one-line notice, when no C++ compiler is found). Only the stand-alone and
    data-parallel form is switched: a cell that forces a redistribution (semi/auto parallel), returns a
    numerator/denominator pair (per-token loss, sequence pipeline) or monitors a local loss stays native."""
    import numpy as np
    import mindspore as ms
    from mindformers.core.loss.loss import CrossEntropyLoss

    def matches(cell):
        return (type(cell) is CrossEntropyLoss and not cell.enable_force_redistribute
                and not cell.calculate_per_token_loss and not cell.seq_pipe and not cell.need_monitor)

    def attach(cell):
        cell.custom_xent = op
        cell.eps_tensor = ms.Tensor(np.array([1e-8], np.float32))  # mindformers' 1e-8, shape (1,) too

    op = xent_op()
    return switch_cells(model, op, "the cross-entropy", matches, custom_cell_class(), attach, log)
