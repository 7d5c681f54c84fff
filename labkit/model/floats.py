"""Floating-point formats from their bit layout: the limits of fp32, fp16 and bf16, half an ulp, and a cast through
a format by MindSpore (notebook 04b, sections 1.2 and 1.7)."""
from __future__ import annotations

import numpy as np

FORMATS = {"float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7)}  # exponent bits, stored mantissa bits


def limits(exponent_bits: int, mantissa_bits: int) -> dict[str, float]:
    """Largest value, smallest normal, smallest subnormal and eps (2^-mantissa bits) of an IEEE-style format."""
    bias = 2 ** (exponent_bits - 1) - 1
    return {"max": (2 - 2.0 ** -mantissa_bits) * 2.0 ** bias, "smallest normal": 2.0 ** (1 - bias),
            "smallest subnormal": 2.0 ** (1 - bias - mantissa_bits), "eps": 2.0 ** -mantissa_bits}


def half_ulp(x, name: str) -> np.ndarray:
    """Half the gap between the representable numbers of format `name` at |x| (the subnormals' gap below the
    smallest normal): an update smaller than this rounds back to x."""
    exponent_bits, mantissa = FORMATS[name]
    tiny = limits(exponent_bits, mantissa)["smallest normal"]
    exponent = np.floor(np.log2(np.maximum(np.abs(np.asarray(x, np.float64)), tiny)))
    return 2.0 ** (exponent - mantissa) / 2


def cast_through(x, dtype) -> np.ndarray:
    """x as float32, cast to the MindSpore dtype and back to float32 (numpy)."""
    import mindspore as ms

    return ms.Tensor(np.asarray(x, np.float32)).astype(dtype).astype(ms.float32).asnumpy()
