"""RMSNorm as a MindSpore custom AOT operator (forward and backward in C++), and the switch that puts it into
mindformers' `LlamaRMSNorm` cells.

Why: MindSpore 2.9's CPU element-wise kernels are slow. mindformers' CPU RMSNorm is five of them (square, mean,
add, rsqrt, two multiplies) plus their backward; one fused loop over each row does the same work in one pass.
The custom path computes in float32 (inputs are cast, as mindformers' own `compute_type` does) and returns the
input's dtype. tests/test_kernels.py holds it equal to the native cell, values and gradients.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build, switch_cells

@functools.lru_cache(maxsize=1)
def rms_norm_op():
    """The forward `ops.Custom` with its backward attached, or None when no C++ compiler is found."""
    from mindspore import ops

    lib = build("rmsnorm")
    if lib is None:
        return None
    backward = ops.Custom(f"{lib}:RmsNormBackward", out_shape=lambda x, w, e, dy: (x, w),
                          out_dtype=lambda x, w, e, dy: (x, w), func_type="aot")
    zeros_like = ops.ZerosLike()

    def bprop(x, w, eps, out, dout):
        dx, dw = backward(x, w, eps, dout)
        return dx, dw, zeros_like(eps)

    op = ops.Custom(f"{lib}:RmsNormForward", out_shape=lambda x, w, e: x, out_dtype=lambda x, w, e: x,
                    func_type="aot", bprop=bprop)
    return op


@functools.lru_cache(maxsize=1)
def custom_cell_class():
    """A `LlamaRMSNorm` subclass whose construct calls the custom operator (same parameter, same name)."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.models.llama.llama_layer import LlamaRMSNorm

    class CustomRMSNorm(LlamaRMSNorm):
        def construct(self, x):
            original_type = x.dtype
            y = self.custom_norm(ops.cast(x, ms.float32), ops.cast(self.weight, ms.float32), self.eps_tensor)
            return ops.cast(y, original_type)

    return CustomRMSNorm


def use_custom_rms_norm(model, log=None) -> int:
    """Switch every non-fused `LlamaRMSNorm` in `model` to the custom operator; returns how many were switched
    (0, with a one-line notice, when no C++ compiler is found: the native cells stay)."""
    import numpy as np
    import mindspore as ms
    from mindformers.models.llama.llama_layer import LlamaRMSNorm

    def attach(cell):
        cell.custom_norm = op
        cell.eps_tensor = ms.Tensor(np.array([cell.eps], np.float32))

    op = rms_norm_op()
    return switch_cells(model, op, "RMSNorm", lambda c: type(c) is LlamaRMSNorm and c.self_define,
                        custom_cell_class(), attach, log)
