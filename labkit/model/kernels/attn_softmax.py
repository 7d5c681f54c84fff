"""Attention's scale + mask + softmax as one MindSpore custom AOT operator (forward and backward in C++), and the
switch that puts it into mindformers' `LLamaAttention` cells.

Without flash attention (always, on CPU) mindformers computes `softmax(score * 1/sqrt(d) + mask)` over [B, H, S, S]
as a broadcast Mul, a broadcast Add and a Softmax, and their backward; the matmuls around it stay MindSpore's. The
custom operator reads each row once forward and once backward (the backward uses the forward's probabilities, which
MindSpore hands to the bprop). Computes in float32 and returns the compute dtype. tests/test_kernels.py holds it
equal to the native cell, values and gradients.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build, switch_cells


@functools.lru_cache(maxsize=1)
def attn_softmax_op():
    """The forward `ops.Custom` with its backward attached, or None when no C++ compiler is found."""
    from mindspore import ops

    lib = build("attn_softmax")
    if lib is None:
        return None
    backward = ops.Custom(f"{lib}:AttnSoftmaxBackward", out_shape=lambda s, m, c, p, dp: s,
                          out_dtype=lambda s, m, c, p, dp: s, func_type="aot")
    zeros_like = ops.ZerosLike()

    def bprop(score, mask, scale, out, dout):
        return backward(score, mask, scale, out, dout), zeros_like(mask), zeros_like(scale)  # constants

    return ops.Custom(f"{lib}:AttnSoftmaxForward", out_shape=lambda s, m, c: s, out_dtype=lambda s, m, c: s,
                      func_type="aot", bprop=bprop)


@functools.lru_cache(maxsize=1)
def custom_cell_class():
    """A `LLamaAttention` subclass whose `_attn` (the non-flash path) calls the custom operator between the two
    batch matmuls."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.models.llama.llama_transformer import LLamaAttention

    class CustomAttention(LLamaAttention):
        def _attn(self, query, key, value, mask):
            score = self.batch_matmul_q_k(query, key)  # [bs, n_head, seq, seq]
            probs = self.custom_softmax(ops.cast(score, ms.float32), ops.cast(mask, ms.float32), self.scale_tensor)
            weighted_values = self.batch_matmul(self.cast(probs, self.dtype), value)
            return self._merge_heads(weighted_values)

    return CustomAttention


def use_custom_attn_softmax(model, log=None) -> int:
    """Switch every training-time `LLamaAttention` on the non-flash path (no KV cache, no context parallelism) to
    the custom operator; returns how many were switched (0, with a one-line notice, when no C++ compiler is found)."""
    import numpy as np
    import mindspore as ms
    from mindformers.models.llama.llama_transformer import LLamaAttention

    def matches(cell):
        return (type(cell) is LLamaAttention and not cell.use_flash_attention and not cell.use_past
                and cell.context_parallel <= 1)

    def attach(cell):
        cell.custom_softmax = op
        cell.scale_tensor = ms.Tensor(np.array([float(cell.inv_norm_factor.asnumpy())], np.float32))

    op = attn_softmax_op()
    return switch_cells(model, op, "the attention softmax", matches, custom_cell_class(), attach, log)
