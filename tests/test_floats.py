"""The formats' limits from their bit layout against numpy's finfo, and half an ulp against numpy's spacing."""
import numpy as np
import pytest

from labkit.model.floats import FORMATS, half_ulp, limits


@pytest.mark.parametrize("name, np_type", [("float32", np.float32), ("float16", np.float16)])
def test_limits_equal_numpy(name, np_type):
    got, f = limits(*FORMATS[name]), np.finfo(np_type)
    assert (got["max"], got["smallest normal"], got["eps"]) == (float(f.max), float(f.tiny), float(f.eps))
    assert got["smallest subnormal"] == float(f.smallest_subnormal)


def test_bfloat16_is_float32_without_its_low_16_bits():
    assert limits(*FORMATS["bfloat16"])["smallest normal"] == limits(*FORMATS["float32"])["smallest normal"]
    assert limits(*FORMATS["bfloat16"])["eps"] == 2.0 ** -7


@pytest.mark.parametrize("name, np_type", [("float32", np.float32), ("float16", np.float16)])
def test_half_ulp_is_half_numpys_spacing(name, np_type):
    x = np.array([1.0, 1.5, 3.0, 1e-3, 6e-8, 0.0], np_type)
    assert np.array_equal(half_ulp(x, name), np.spacing(np.abs(x)).astype(np.float64) / 2)
