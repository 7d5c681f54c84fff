"""The optimizer step as two C++ operators: AdamW updating weights and moments in place with the gradient scaling
folded in, and the sum of squares behind the global gradient norm.

MindSpore's `nn.AdamWeightDecay` runs one `AdamWeightDecay` kernel per parameter; before it, the trainer divides
every gradient (accumulation, loss scale), squares it into a copy for the norm's ReduceSum and multiplies it by
the clipping factor: three more passes over all gradients. With these operators the norm reads each gradient once
(`SquareSum`, scaled by `k`), and the update (`AdamWUpdate`) applies `gscale = clip factor / divisor` as it reads
the gradient. The formula is AdamWeightDecay's own (no bias correction, as in MindSpore), so a run with them
follows the native run within float32 rounding; tests/test_kernels.py holds the two equal.

The update writes its first three inputs, as MindSpore's optimizer kernels do: its class declares them written
(`sig_rw.RW_WRITE`, attribute `side_effect_mem`), so the graph orders every later read of a weight after it.
"""
from __future__ import annotations

import functools

from labkit.model.kernels.build import build


@functools.lru_cache(maxsize=1)
def adamw_ops():
    """(update, square_sum) as `ops.Custom`s, or None when no C++ compiler is found.

    update(var, m, v, lr, beta1, beta2, eps, decay, grad, gscale) writes var, m and v; square_sum(k, grad) is the
    scalar sum((k * grad)^2) (k first, so that `F.partial(square_sum, k)` maps over a gradient tuple)."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.ops import signature as sig

    lib = build("adamw")
    if lib is None:
        return None

    class InPlaceAdamW(ops.Custom):
        __mindspore_signature__ = (  # AdamWeightDecay's, with gscale: var, m, v are written; scalars are float32
            sig.make_sig("var", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T),
            sig.make_sig("m", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T1),
            sig.make_sig("v", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T1),
            *(sig.make_sig(name, dtype=sig.sig_dtype.T2) for name in ("lr", "beta1", "beta2", "epsilon", "decay")),
            sig.make_sig("gradient", dtype=sig.sig_dtype.T),
            sig.make_sig("gscale", dtype=sig.sig_dtype.T2),
        )

        def __init__(self):
            super().__init__(f"{lib}:AdamWUpdate", out_shape=lambda *shapes: [1],
                             out_dtype=lambda *dtypes: ms.float32, func_type="aot")
            self.add_prim_attr("side_effect_mem", True)

    square_sum = ops.Custom(f"{lib}:SquareSum", out_shape=lambda k, g: [], out_dtype=lambda k, g: g,
                            func_type="aot")
    return InPlaceAdamW(), square_sum


@functools.lru_cache(maxsize=1)
def optimizer_class():
    """`nn.AdamWeightDecay` with the fused update: called as `opt(gradients, gscale)`. The same parameters, moments
    (`adam_m.*`, `adam_v.*`), schedule and step counter as its base, so checkpoints are interchangeable. Parameter
    groups with one learning rate (labkit's decay / no-decay groups)."""
    from mindspore import nn
    from mindspore.ops import composite as C
    from mindspore.ops import functional as F

    update = C.MultitypeFuncGraph("labkit_adamw_update")

    @update.register("Function", "Tuple", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Bool")
    def _update(op, step, decay, param, m, v, grad, decay_flag):
        beta1, beta2, eps, lr, gscale = step  # what every parameter's update of this step shares
        if decay_flag:
            return op(param, m, v, lr, beta1, beta2, eps, decay, grad, gscale)
        return op(param, m, v, lr, beta1, beta2, eps, 0.0, grad, gscale)

    class FusedAdamWeightDecay(nn.AdamWeightDecay):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
            if not self.is_group or self.is_group_lr:
                raise ValueError("FusedAdamWeightDecay takes parameter groups sharing one learning rate")
            self.fused_update = adamw_ops()[0]

        def construct(self, gradients, gscale):
            decay = self.get_weight_decay()
            lr = self.get_lr()
            self.assignadd(self.global_step, self.global_step_increase_tensor)
            step = (self.beta1, self.beta2, self.eps, lr, gscale)
            return self.hyper_map(F.partial(update, self.fused_update, step),
                                  decay, self._parameters, self.moments1, self.moments2, gradients, self.decay_flags)

    return FusedAdamWeightDecay
