"""The all-reduce probe: msrun workers time all-reduces of the model's gradient shapes on the real backend."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from labkit.errors import LabkitError, LabkitFailure
from labkit.launch.validate import CLUSTER_ENV, free_port, python_on_path
from labkit.launch.supervisor import POLL_S, Supervisor, log_tail
from labkit.parallel.msrun import NO_TAIL, msrun_args, msrun_head
from labkit.model.shapes import grad_shapes


def measure_allreduce(model="tiny", workers: int = 2, sizes=(1_000, 100_000, 1_000_000, 4_000_000),
                      repeats: int = 10, output=None, timeout: float = 300,
                      env_vars=("NCCL_ALGO", "NCCL_IB_DISABLE", "HCCL_CONNECT_TIMEOUT")) -> dict:
    """Time MindSpore's gradient all-reduce between `workers` processes on this machine (msrun, mccl on CPU).

    Measures `nn.DistributedGradReducer(mean=True)` (what training uses) on zero tensors shaped like `model`'s
    gradients, and a single float32 buffer of each size in `sizes` (elements), the median of `repeats` timed
    calls each, after a warm-up and with ranks aligned before each call. Also reports the communication backend
    and which of the libraries the worker has loaded mention each of `env_vars` (a library that reads a variable
    holds its name)."""
    from labkit.config import ModelConfig, model_preset
    from labkit.paths import RUNS

    if workers < 2:
        raise LabkitError("measure_allreduce needs at least 2 workers")
    mcfg = model if isinstance(model, ModelConfig) else model_preset(model)
    out = Path(output) if output else RUNS / "probe" / f"allreduce_{workers}w"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec = out / "probe.json"
    result_file = out / "result.json"
    result_file.unlink(missing_ok=True)
    spec.write_text(json.dumps({"model": [list(s) for s in grad_shapes(mcfg)], "sizes": list(sizes),
                                "repeats": repeats, "result": str(result_file.resolve()),
                                "env_vars": list(env_vars)}), encoding="utf-8")
    cmd = msrun_args(workers, workers, master_port=free_port(), log_dir=logs.resolve(), cluster_time_out=120,
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
    os.environ.setdefault("GLOG_v", "3")
    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    rank, size, align = _join_cluster()
    model = _time_reduce([tuple(s) for s in spec["model"]], rank, size, spec["repeats"], align)
    sweep = [_time_reduce([(int(n),)], rank, size, spec["repeats"], align) for n in spec["sizes"]]
    if rank == 0:
        _write_result(spec, size, model, sweep)
    align()


def _join_cluster():
    """init() the communication and return (rank, size, align) where align() is an all-reduce barrier."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank, init

    from labkit.parallel import context as parallel

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    rank, size = get_rank(), get_group_size()
    parallel.set_parallel_context("data_parallel", device_num=size, init_communication=False)
    align_op = ops.AllReduce()
    one = ms.Tensor([1.0], ms.float32)

    @ms.jit
    def reduce_one(x):
        return align_op(x)

    return rank, size, lambda: reduce_one(one).asnumpy()


def _time_reduce(shapes, rank: int, size: int, repeats: int, align) -> dict:
    """Median time of DistributedGradReducer(mean=True) over tensors of `shapes`, ranks aligned before each call."""
    import statistics

    import numpy as np
    import mindspore as ms
    from mindspore import nn

    params = ms.ParameterTuple(ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
                               for i, s in enumerate(shapes))
    reducer = nn.DistributedGradReducer(params, mean=True, degree=size)
    grads = tuple(ms.Tensor(np.full(s, rank + 1.0, np.float32)) for s in shapes)

    @ms.jit
    def run(g):
        return reducer(g)

    check = float(run(grads)[0].asnumpy().ravel()[0])  # compile + warm-up; mean of 1..size
    seconds = []
    for _ in range(repeats):
        align()
        t = time.perf_counter()
        res = run(grads)
        res[-1].asnumpy()
        seconds.append(time.perf_counter() - t)
    numel = int(sum(np.prod(s) for s in shapes))
    med = statistics.median(seconds)
    return {"tensors": len(shapes), "numel": numel, "mbytes": numel * 4 / 1e6, "median_s": med,
            "min_s": min(seconds), "algbw_gbps": numel * 4 / med / 1e9, "mean_ok": abs(check - (size + 1) / 2) < 1e-6}


def _write_result(spec: dict, size: int, model: dict, sweep: list) -> None:
    from mindspore.communication import GlobalComm

    from labkit.io import atomic_write_text

    libs = _loaded_libraries()
    atomic_write_text(spec["result"], json.dumps({
        "workers": size, "backend": str(GlobalComm.BACKEND), "model_grads": model, "sizes": sweep,
        "loaded_libraries": [p.name for p in libs],
        "env_readers": {v: _libraries_mentioning(libs, v) for v in spec.get("env_vars", [])}}))
