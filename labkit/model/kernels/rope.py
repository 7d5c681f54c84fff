"""Rotary position embedding as a MindSpore custom AOT operator (forward and backward in C++), and the switch that
puts it into mindformers' `RotaryEmbedding` cells.

mindformers rotates query and key with broadcast multiplies of [B, H, S, D] by [1, 1, S, D] cos/sin tables, an add,
and a batch matmul with a swap mask for rot(x) = [-x2, x1]; MindSpore 2.9's CPU broadcast multiply is a scalar
loop (bench/elementwise.py). The custom operator does the same arithmetic in one vectorised pass, and its backward
is the transposed rotation (RoPE is linear in x). Computes in float32 and returns the input's dtype.
tests/test_kernels.py holds it equal to the native cell, values and gradients.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build, switch_cells


@functools.lru_cache(maxsize=1)
def rope_op():
    """The forward `ops.Custom` with its backward attached, or None when no C++ compiler is found."""
    from mindspore import ops

    lib = build("rope")
    if lib is None:
        return None
    backward = ops.Custom(f"{lib}:RopeBackward", out_shape=lambda x, c, s, dy: x, out_dtype=lambda x, c, s, dy: x,
                          func_type="aot")
    zeros_like = ops.ZerosLike()

    def bprop(x, cos, sin, out, dout):
        return backward(x, cos, sin, dout), zeros_like(cos), zeros_like(sin)  # the tables are constants

    return ops.Custom(f"{lib}:RopeForward", out_shape=lambda x, c, s: x, out_dtype=lambda x, c, s: x,
                      func_type="aot", bprop=bprop)


@functools.lru_cache(maxsize=1)
def custom_cell_class():
    """A `RotaryEmbedding` subclass whose construct rotates query and key with the custom operator."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.modules.layers import RotaryEmbedding

    class CustomRotaryEmbedding(RotaryEmbedding):
        def construct(self, xq, xk, freqs_cis):
            freqs_cos, freqs_sin, _ = freqs_cis  # [1, 1, S, D] tables; the swap mask is the rotation, built in
            cos, sin = ops.cast(freqs_cos, ms.float32), ops.cast(freqs_sin, ms.float32)
            q = self.custom_rope(ops.cast(xq, ms.float32), cos, sin)
            k = self.custom_rope(ops.cast(xk, ms.float32), cos, sin)
            return ops.cast(q, xq.dtype), ops.cast(k, xk.dtype)

    return CustomRotaryEmbedding


def use_custom_rope(model, log=None) -> int:
    """Switch every training-time `RotaryEmbedding` (no 3-D tensor parallelism) to the custom operator; returns how
    many were switched (0, with a one-line notice, when no C++ compiler is found). Tables with a batch axis
    (per-sample positions) are refused by the kernel itself, which checks that cos and sin hold S x D values."""
    from mindformers.modules.layers import RotaryEmbedding

    def matches(cell):
        return type(cell) is RotaryEmbedding and not cell.use_3d_tensor_parallel

    def attach(cell):
        cell.custom_rope = op

    op = rope_op()
    return switch_cells(model, op, "RoPE", matches, custom_cell_class(), attach, log)
