"""The all-reduce probe: msrun workers time all-reduces of the model's gradient shapes on the real backend."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.byhand.comm import io_bytes
from labkit.config import ModelConfig, ParallelConfig, model_preset
from labkit.errors import LabkitError, LabkitFailure
from labkit.io import atomic_write_text
from labkit.launch.supervisor import POLL_S, Supervisor, log_tail
from labkit.launch.validate import CLUSTER_ENV, free_port, python_on_path
from labkit.model.shapes import grad_shapes
from labkit.parallel import context as parallel
from labkit.parallel.msrun import NO_TAIL, Cluster, msrun_args, msrun_head
from labkit.paths import RUNS


@dataclass(frozen=True)
class AllreduceTimings:
    """What the all-reduce probe times (see measure_allreduce): buffers of `sizes` elements through the gradient
    reducer and bare ops.AllReduce buffers of `raw_sizes`, in each of `dtypes`, the median of `repeats` calls, and
    which of the worker's loaded libraries mention each of `env_vars`."""

    sizes: tuple = (1_000, 100_000, 1_000_000, 4_000_000)
    repeats: int = 10
    dtypes: tuple = ("float32",)
    raw_sizes: tuple = ()
    env_vars: tuple = ("NCCL_ALGO", "NCCL_IB_DISABLE", "HCCL_CONNECT_TIMEOUT")


def measure_allreduce(model="tiny", workers: int = 2, timings: AllreduceTimings = AllreduceTimings(), *,
                      output=None, timeout: float = 300) -> dict:
    """Time MindSpore's gradient all-reduce between `workers` processes on this machine (msrun, mccl on CPU).

    Measures `nn.DistributedGradReducer(mean=True)` (what training uses) on zero tensors shaped like `model`'s
    gradients, and a single float32 buffer of each size in `sizes` (elements), the median of `repeats` timed
    calls each, after a warm-up and with ranks aligned before each call. Also reports the communication backend
    and which of the libraries the worker has loaded mention each of `env_vars` (a library that reads a variable
    holds its name).

    `dtypes` (numpy names, e.g. ("float32", "float16")) are all timed in the same launch; the result's
    `model_grads` and `sizes` are the first dtype's, `by_dtype` holds every dtype's. Each timing also counts the
    bytes the rank-0 worker passed to read/write system calls during the timed calls (/proc/self/io), which is
    where the socket traffic of a CPU all-reduce shows. The reducer casts every gradient to float32 before its
    AllReduce (MindSpore's grad_reducer.py); each of `raw_sizes` is timed as a bare `ops.AllReduce` (sum) in each
    dtype (`by_dtype[d]["raw_sizes"]`), which sends the dtype as it is."""
    if workers < 2:
        raise LabkitError("measure_allreduce needs at least 2 workers")
    mcfg = model if isinstance(model, ModelConfig) else model_preset(model)
    out = Path(output) if output else RUNS / "probe" / f"allreduce_{workers}w"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec = out / "probe.json"
    result_file = out / "result.json"
    result_file.unlink(missing_ok=True)
    t = timings
    spec.write_text(json.dumps({"model": [list(s) for s in grad_shapes(mcfg)], "sizes": list(t.sizes),
                                "repeats": t.repeats, "result": str(result_file.resolve()),
                                "env_vars": list(t.env_vars), "dtypes": list(t.dtypes),
                                "raw_sizes": list(t.raw_sizes)}), encoding="utf-8")
    cmd = msrun_args(Cluster(workers, workers, master_port=free_port(), cluster_time_out=120), log_dir=logs.resolve(),
                     tail_worker_log=NO_TAIL, head=msrun_head())
    cmd += ["python", "-m", "labkit.launch", "probe", str(spec.resolve())]
    env = python_on_path({k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}, logs / ".bin")
    env.setdefault("GLOG_v", "3")
    env.setdefault("MS_OM_PATH", str(logs.resolve()))
    with open(logs / "msrun.log", "w", encoding="utf-8") as sink:
        root = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sup = Supervisor(root, single=False, workers=workers, msrun_log=logs / "msrun.log", timeout=timeout)
    try:
        while not result_file.exists() and not sup.poll().done:
            time.sleep(POLL_S)
        time.sleep(0.5)
    finally:
        sup.stop()
    if not result_file.exists():
        raise LabkitFailure("the all-reduce probe did not finish", f"see {logs}:\n{log_tail(logs / 'worker_0.log')}")
    return json.loads(result_file.read_text(encoding="utf-8"))


def _loaded_libraries() -> list[Path]:
    """Shared libraries mapped into this process (Linux /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({Path(line.split()[-1]) for line in maps if ".so" in line.rsplit("/", 1)[-1]})


def _libraries_mentioning(libs: list[Path], name: str) -> list[str]:
    """Which of `libs` contain the string `name` (e.g. an environment variable they read)."""
    import mmap

    hits = []
    for lib in libs:
        try:
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name.encode()) != -1:
                    hits.append(lib.name)
        except (OSError, ValueError):
            pass
    return hits


def probe_worker(spec_file: str) -> None:
    """`python -m labkit.launch probe SPEC` under msrun: rank 0 writes the timings named in SPEC."""
    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    rank, size, align = _join_cluster()
    by_dtype = {}
    for dtype in spec.get("dtypes", ["float32"]):
        model = _time_reduce([tuple(s) for s in spec["model"]], rank, size, spec["repeats"], align, dtype)
        sweep = [_time_reduce([(int(n),)], rank, size, spec["repeats"], align, dtype) for n in spec["sizes"]]
        by_dtype[dtype] = {"model_grads": model, "sizes": sweep}
        by_dtype[dtype]["raw_sizes"] = [_time_reduce([(int(n),)], rank, size, spec["repeats"], align, dtype,
                                                     raw=True) for n in spec.get("raw_sizes", [])]
    if rank == 0:
        _write_result(spec, size, by_dtype)
    align()


def _join_cluster():
    """init() the communication and return (rank, size, align) where align() is an all-reduce barrier."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank, init


    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    rank, size = get_rank(), get_group_size()
    parallel.set_parallel_context(ParallelConfig(parallel_mode="data_parallel"), device_num=size,
                                  init_communication=False)
    align_op = ops.AllReduce()
    one = ms.Tensor([1.0], ms.float32)

    @ms.jit
    def reduce_one(x):
        return align_op(x)

    return rank, size, lambda: reduce_one(one).asnumpy()


def _time_reduce(shapes, rank: int, size: int, repeats: int, align, dtype: str = "float32", raw: bool = False) -> dict:
    """Median time of DistributedGradReducer(mean=True) over tensors of `shapes` in `dtype` (`raw`: a bare
    ops.AllReduce sum of each, and `mean_ok` checks the sum), ranks aligned before each call; `io_bytes_per_call` is
    what this process read and wrote through system calls per call, counted from before the first call to after
    all ranks have finished the last."""
    import statistics

    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    np_dtype = np.dtype(dtype)
    params = ms.ParameterTuple(ms.Parameter(ms.Tensor(np.zeros(s, np_dtype)), name=f"p{i}")
                               for i, s in enumerate(shapes))
    reducer = ops.AllReduce() if raw else nn.DistributedGradReducer(params, mean=True, degree=size)
    grads = tuple(ms.Tensor(np.full(s, rank + 1.0, np_dtype)) for s in shapes)

    @ms.jit
    def run(g):
        return tuple(reducer(x) for x in g) if raw else reducer(g)

    check = float(run(grads)[0].asnumpy().ravel()[0])  # compile + warm-up; mean (raw: sum) of 1..size
    expected = size * (size + 1) / 2 if raw else (size + 1) / 2
    seconds = []
    align()
    io_start = io_bytes()
    for _ in range(repeats):
        align()
        t = time.perf_counter()
        res = run(grads)
        res[-1].asnumpy()
        seconds.append(time.perf_counter() - t)
    align()  # every rank done: a send still in flight when rank 0's result arrived is counted too
    io = io_bytes() - io_start  # the aligning all-reduces of one float add a few hundred bytes
    numel = int(sum(np.prod(s) for s in shapes))
    nbytes = numel * np_dtype.itemsize
    med = statistics.median(seconds)
    return {"dtype": dtype, "tensors": len(shapes), "numel": numel, "mbytes": nbytes / 1e6, "median_s": med,
            "min_s": min(seconds), "algbw_gbps": nbytes / med / 1e9, "io_bytes_per_call": io / repeats,
            "raw": raw, "mean_ok": abs(check - expected) < 1e-6}


def _write_result(spec: dict, size: int, by_dtype: dict) -> None:
    from mindspore.communication import GlobalComm


    libs = _loaded_libraries()
    first = next(iter(by_dtype.values()))
    atomic_write_text(spec["result"], json.dumps({
        "workers": size, "backend": str(GlobalComm.BACKEND), **first, "by_dtype": by_dtype,
        "loaded_libraries": [p.name for p in libs],
        "env_readers": {v: _libraries_mentioning(libs, v) for v in spec.get("env_vars", [])}}))
