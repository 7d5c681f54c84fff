"""Accelerator presets for planning (memory, peak FLOP/s, interconnect) and a GEMM probe for this machine.

Peak figures are dense (no sparsity) tensor-core/cube throughput per device as the vendors publish them, or
measured where no official figure exists. They are what MFU is measured against: override them when you know
your SKU better (`plan(..., peak_tflops=...)`, `labkit plan --peak-tflops`, the training config's `peak_tflops`).

Bandwidths are GB/s (1e9 bytes/s) per device, one direction, as a collective sees them: the planner divides the
bytes each device sends by this figure. They are nominal link rates, not measured collective bandwidths.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import time
from dataclasses import dataclass, field

from labkit.errors import LabkitError

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str  # preset key
    memory_gib: float  # device memory (GiB = 2**30 bytes)
    peak_tflops: dict = field(default_factory=dict)  # dtype ("fp16", "bf16", "fp32") -> dense peak TFLOP/s
    intra_node_gbps: float = 0.0  # GB/s per device, one direction, between devices of one node
    inter_node_gbps: float = 0.0  # GB/s per device, one direction, between nodes
    devices_per_node: int = 8  # devices in one server
    source: str = ""  # where the figures come from
    overhead_gib: float = 2.0  # memory the framework/runtime/communication buffers take before the model (GiB)
    label: str = ""  # human name

    def peak(self, precision: str) -> float:
        """Peak TFLOP/s for a precision ("fp16", "bf16", "fp32")."""
        if precision not in self.peak_tflops or not self.peak_tflops[precision]:
            raise LabkitError(f"device preset '{self.name}' has no peak for {precision}",
                              "pass peak_tflops=... (TFLOP/s) or --peak-tflops")
        return float(self.peak_tflops[precision])


DEVICE_PRESETS: dict[str, Device] = {
    "atlas_800t_a2": Device(
        name="atlas_800t_a2", label="Atlas 800T A2 (Ascend 910B, 64 GB)", memory_gib=64.0,
        peak_tflops={"fp16": 313.0, "bf16": 313.0, "fp32": 78.0},
        intra_node_gbps=196.0, inter_node_gbps=25.0, devices_per_node=8, overhead_gib=6.0,
        source=("No official 910B peak found: 313 TFLOP/s fp16/bf16 is the figure most third-party pages quote "
                "(others say 320 or 376; one benchmark measured 328 bf16). fp32 taken as 1/4 of it (unverified). "
                "Memory 64 GB HBM2e. HCCS full mesh of 8 NPUs, 7 links x 56 GB/s bidirectional -> ~196 GB/s one "
                "direction per card; 8 x 200 GE RoCE per server -> 25 GB/s per card across nodes. Overhead: "
                "mindformers' Llama-2 recipes set max_device_memory 58GB of 64 (6 GB left to runtime/HCCL)."),
    ),
    "a100_80g": Device(
        name="a100_80g", label="NVIDIA A100 SXM 80 GB", memory_gib=80.0,
        peak_tflops={"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
        intra_node_gbps=300.0, inter_node_gbps=25.0, devices_per_node=8, overhead_gib=2.0,
        source=("NVIDIA A100 datasheet: 312 TFLOP/s dense fp16/bf16 tensor core, 19.5 fp32 (156 TF32); "
                "NVLink 3 600 GB/s bidirectional -> 300 one direction; one 200 Gb/s HDR InfiniBand NIC per GPU "
                "-> 25 GB/s. Overhead: CUDA context + NCCL buffers (~0.5-2 GB, Fujii et al. 2024)."),
    ),
    "h100_80g": Device(
        name="h100_80g", label="NVIDIA H100 SXM 80 GB", memory_gib=80.0,
        peak_tflops={"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
        intra_node_gbps=450.0, inter_node_gbps=50.0, devices_per_node=8, overhead_gib=2.0,
        source=("NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16/fp16 (1979 with sparsity), 67 fp32; "
                "NVLink 4 900 GB/s bidirectional -> 450 one direction; one 400 Gb/s NDR NIC per GPU -> 50 GB/s. "
                "torchtitan uses the same 989e12 peak for MFU."),
    ),
    "h200_141g": Device(
        name="h200_141g", label="NVIDIA H200 SXM 141 GB", memory_gib=131.0,
        peak_tflops={"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
        intra_node_gbps=450.0, inter_node_gbps=50.0, devices_per_node=8, overhead_gib=2.0,
        source=("NVIDIA H200 datasheet: same compute as H100 SXM (989 TFLOP/s dense bf16), 141 GB HBM3e "
                "(= 131 GiB); NVLink 4 and 400 Gb/s NICs as H100."),
    ),
    "cpu": Device(
        name="cpu", label="this machine's CPU", memory_gib=0.0, peak_tflops={},
        intra_node_gbps=5.0, inter_node_gbps=1.0, devices_per_node=1, overhead_gib=0.0,
        source=("Peak: a MindSpore float32 GEMM probe on this machine (measure_gemm_peak), filled in by "
                "device_preset('cpu'). Memory: host RAM. Bandwidths: nominal values, not measured."),
    ),
}


def device_preset(name: str, *, measure: bool = True) -> Device:
    """A device preset by name. For "cpu" the peak is measured once per process and memory is the host RAM."""
    if name not in DEVICE_PRESETS:
        close = difflib.get_close_matches(name, list(DEVICE_PRESETS), n=1)
        raise LabkitError(f"unknown device preset '{name}'",
                          f"did you mean '{close[0]}'?" if close else f"presets: {', '.join(DEVICE_PRESETS)}")
    dev = DEVICE_PRESETS[name]
    if name == "cpu":
        import psutil

        peak = {}
        if measure:
            fp32 = cached_gemm_peak() / 1e12
            peak = {"fp32": fp32, "fp16": fp32, "bf16": fp32}  # CPU runs fp32 here; half precision is not faster
        dev = dataclasses.replace(dev, memory_gib=round(psutil.virtual_memory().total / GIB, 1), peak_tflops=peak)
    return dev


@functools.lru_cache(maxsize=1)
def cached_gemm_peak() -> float:
    """measure_gemm_peak() once per process, for the MFU of runs without a peak_tflops setting: 0.5 s of timed
    runs (about 11 runs of four 1024^3 matmuls here, of which the best counts), a second less of every training
    process's start than the default budget. The bench, whose peak is published, keeps the default."""
    return measure_gemm_peak(seconds=0.5)


def measure_gemm_peak(n: int = 1024, dtype: str = "float32", repeats: int | None = None,
                      seconds: float = 1.5) -> float:
    """FLOP/s of an n x n x n MindSpore matmul on this machine, measured the way training runs it: inside
    `@ms.jit` (a compiled graph), warmed up, best of several timed runs.

    A PyNative `ops.matmul(...).asnumpy()` loop under-reads the peak: the Python thread spins while it waits and
    takes one of the cores the GEMM needs, and an MFU measured against that peak can exceed 1. Takes about
    `seconds` (1-3 s). The best run is reported because other processes on a shared machine only ever slow a run
    down. `repeats` fixes the number of timed runs instead of the time budget. For a figure to publish, call it in a
    fresh process (bench/train_throughput.py does): a process that already trained holds a warmed, busier pool."""
    import numpy as np
    import mindspore as ms
    from mindspore import ops

    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise LabkitError(f"measure_gemm_peak: dtype '{dtype}' is not supported", "use float32 or float16")
    if n < 16:
        raise LabkitError(f"measure_gemm_peak: n={n} is too small to measure", "use n >= 256")
    rng = np.random.default_rng(0)
    per_run = 4  # matmuls per timed run: one result read back per run, not per matmul
    # one left operand per matmul: the graph compiler merges identical nodes (common-subexpression elimination),
    # so 4 x matmul(a, b) ran as fewer matmuls and read as a 2-4x too high peak (measured 404 vs 208 GFLOP/s)
    lhs = tuple(ms.Tensor(rng.standard_normal((n, n)).astype(np_dtype)) for _ in range(per_run))
    b = ms.Tensor(rng.standard_normal((n, n)).astype(np_dtype))

    @ms.jit
    def gemms(xs, y):
        out = ops.matmul(xs[0], y)
        for i in range(1, per_run):
            out = ops.depend(ops.matmul(xs[i], y), out)
        return out

    for _ in range(2):  # compile, kernel selection, thread pool warm-up
        gemms(lhs, b).asnumpy()
    best, runs, start = float("inf"), 0, time.perf_counter()
    while True:
        t = time.perf_counter()
        gemms(lhs, b).asnumpy()
        best = min(best, time.perf_counter() - t)
        runs += 1
        if repeats is not None and runs >= repeats:
            break
        if repeats is None and (time.perf_counter() - start > seconds and runs >= 3):
            break
    return 2.0 * n**3 * per_run / best


# /proc/cpuinfo flag -> what it gives matrix math (x86; the kernel's names)
MATRIX_ISA_FLAGS = (
    ("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX-512 VNNI (int8)"),
    ("avx512_bf16", "AVX-512 BF16"), ("avx512_fp16", "AVX-512 FP16"),
    ("amx_tile", "AMX"), ("amx_bf16", "AMX BF16"), ("amx_int8", "AMX INT8"), ("amx_fp16", "AMX FP16"),
)


def cpu_matrix_isa(cpuinfo: str | None = None) -> dict:
    """The CPU's matrix instruction sets from /proc/cpuinfo flags: what a bf16/fp16 GEMM can really use here.

    Without AVX-512 BF16 or AMX BF16 a bfloat16 matmul is emulated: with AVX-512 it is converted to float32 and is
    no faster than float32; with AVX2 alone torch 2.13 runs a scalar loop (1.3 against 168 GFLOP/s fp32 at n=512 on
    a 2-core EPYC). With AMX it can be several times faster (torch bf16 ~6x fp32 on a 2-core Xeon). Returns the
    model name, the list of matrix extensions found and a one-line `summary`."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    found = [label for flag, label in MATRIX_ISA_FLAGS if flag in flags]
    bf16 = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512_bf16" in flags else "none (emulated)"
    best = next((lab for lab in ("AMX", "AVX-512", "AVX2") if lab in found), "none of AVX2/AVX-512/AMX")
    summary = (f"{model or 'unknown CPU'}: {best}; native bf16 matmul: {bf16}" if flags else
               "no /proc/cpuinfo flags (not Linux x86?)")
    return {"model": model, "matrix_isa": found, "bf16_native": bf16 != "none (emulated)", "summary": summary}
