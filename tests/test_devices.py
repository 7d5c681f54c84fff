"""Device presets (sources, peaks, memory) and the GEMM probe."""
from __future__ import annotations

import pytest

from labkit.parallel.devices import DEVICE_PRESETS, Device, device_preset, measure_gemm_peak
from labkit.errors import LabkitError


def test_presets_have_sources_and_figures():
    for name in ("atlas_800t_a2", "a100_80g", "h100_80g", "h200_141g", "cpu"):
        dev = DEVICE_PRESETS[name]
        assert isinstance(dev, Device) and dev.name == name and len(dev.source) > 40
    assert DEVICE_PRESETS["atlas_800t_a2"].memory_gib == 64
    assert DEVICE_PRESETS["a100_80g"].peak("bf16") == 312 and DEVICE_PRESETS["h100_80g"].peak("bf16") == 989
    assert DEVICE_PRESETS["h200_141g"].memory_gib == pytest.approx(141e9 / 2**30, abs=0.5)
    for dev in DEVICE_PRESETS.values():
        if dev.name != "cpu":
            assert dev.peak("fp16") > 100 and dev.intra_node_gbps > dev.inter_node_gbps > 0


def test_unknown_preset_and_missing_peak():
    with pytest.raises(LabkitError, match="did you mean 'a100_80g'"):
        device_preset("a100_80")
    with pytest.raises(LabkitError, match="no peak"):
        device_preset("cpu", measure=False).peak("fp32")


def test_gemm_probe_and_cpu_preset():
    flops = measure_gemm_peak(n=256, repeats=3)
    assert 1e8 < flops < 1e13  # between 0.1 GFLOP/s and 10 TFLOP/s on any CPU
    cpu = device_preset("cpu")
    assert cpu.peak("fp32") > 1e-4 and cpu.memory_gib > 1
    with pytest.raises(LabkitError):
        measure_gemm_peak(n=256, dtype="int8")
