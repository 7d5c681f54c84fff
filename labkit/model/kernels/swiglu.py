"""SwiGLU's element-wise part (silu(gate) * up) as a MindSpore custom AOT operator, forward and backward in C++,
and the switch that puts it into mindformers' `LlamaFeedForward` cells.

mindformers computes it as three CPU kernels (SiLU inside `w1`, then Mul) and their backward; the custom operator
reads gate and up once and writes once. Computes in float32 and returns the input's dtype.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build, switch_cells


@functools.lru_cache(maxsize=1)
def swiglu_op():
    """The forward `ops.Custom` with its backward attached, or None when no C++ compiler is found."""
    from mindspore import ops

    lib = build("swiglu")
    if lib is None:
        return None
    backward = ops.Custom(f"{lib}:SwiGluBackward", out_shape=lambda g, u, d: (g, u),
                          out_dtype=lambda g, u, d: (g, u), func_type="aot")

    def bprop(gate, up, out, dout):
        return backward(gate, up, dout)

    return ops.Custom(f"{lib}:SwiGluForward", out_shape=lambda g, u: g, out_dtype=lambda g, u: g,
                      func_type="aot", bprop=bprop)


@functools.lru_cache(maxsize=1)
def custom_cell_class():
    """A `LlamaFeedForward` subclass: w1 without its SiLU, then the custom operator, then w2 (same parameters)."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.models.llama.llama_layer import LlamaFeedForward

    class CustomFeedForward(LlamaFeedForward):
        def construct(self, x):
            x = self.cast(x, self.dtype)
            gate = self.w1(x)  # w1's activation is switched off: SiLU happens in the custom operator
            up = self.w3(x)
            hidden = self.custom_swiglu(ops.cast(gate, ms.float32), ops.cast(up, ms.float32))
            return self.w2(ops.cast(hidden, up.dtype))

    return CustomFeedForward


def use_custom_swiglu(model, log=None) -> int:
    """Switch every plain (not concatenated, not fused, no experts) `LlamaFeedForward` whose w1 applies SiLU to
    the custom operator; returns how many were switched (0, with a one-line notice, when no C++ compiler is
    found)."""
    from mindformers.models.llama.llama_layer import LlamaFeedForward, LlamaSiLU

    def matches(cell):
        return (type(cell) is LlamaFeedForward and not cell.ffn_concat and not cell.use_fused_swiglu
                and cell.expert_num == 1 and isinstance(cell.w1.activation, LlamaSiLU))

    def attach(cell):
        cell.custom_swiglu = op
        cell.w1.activation_flag = False

    op = swiglu_op()
    return switch_cells(model, op, "SwiGLU", matches, custom_cell_class(), attach, log)
