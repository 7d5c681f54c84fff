"""The lab's own CPU kernels (C++ sources compiled on first use) and MindSpore custom operators over them:
RMSNorm (rmsnorm.py), SwiGLU's element-wise part (swiglu.py), the rotary position embedding (rope.py), attention's
scale + mask + softmax (attn_softmax.py), the softmax cross-entropy over the logits (xent.py) and the optimizer's
AdamW update with the gradient norm (adamw.py, which the trainer picks); aot.h and fast_exp.h are what their C++
shares. `use_custom_kernels` switches a mindformers Llama to them; without a C++ compiler it leaves the native cells
and says so in one line."""
from __future__ import annotations

import sys

from labkit.model.kernels.attn_softmax import use_custom_attn_softmax
from labkit.model.kernels.build import compiler
from labkit.model.kernels.rmsnorm import use_custom_rms_norm
from labkit.model.kernels.rope import use_custom_rope
from labkit.model.kernels.swiglu import use_custom_swiglu
from labkit.model.kernels.xent import use_custom_cross_entropy

KERNELS = ("native", "custom")


def use_custom_kernels(model, log=None) -> dict:
    """Switch the model's RMSNorm, SwiGLU, RoPE, attention-softmax and cross-entropy cells to the custom operators;
    returns how many of each."""
    if compiler() is None:
        (log or (lambda m: print(m, file=sys.stderr)))(
            "kernels: no C++ compiler found (g++/c++ or $CXX); MindSpore's native operators run instead")
        return {"rms_norm": 0, "swiglu": 0, "rope": 0, "attn_softmax": 0, "cross_entropy": 0}
    return {"rms_norm": use_custom_rms_norm(model, log), "swiglu": use_custom_swiglu(model, log),
            "rope": use_custom_rope(model, log), "attn_softmax": use_custom_attn_softmax(model, log),
            "cross_entropy": use_custom_cross_entropy(model, log)}
