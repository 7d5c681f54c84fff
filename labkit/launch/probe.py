"""The all-reduce probe: msrun workers time all-reduces of the model's gradient shapes on the real backend."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from labkit.errors import LabkitError, LabkitFailure
from labkit.launch.validate import CLUSTER_ENV, NO_TAIL, free_port, python_on_path
from labkit.launch.supervisor import Job, MSRUN_WORKER_ERROR, POLL_S, log_tail, read_log
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
    msrun = Path(sys.executable).parent / "msrun"
    head = [str(msrun)] if msrun.exists() else [sys.executable, "-m", "mindspore.parallel.cluster.run"]
    cmd = head + [f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port()}",
                  f"--log_dir={logs.resolve()}", "--join=True", "--cluster_time_out=120",
                  f"--tail_worker_log={NO_TAIL}", "python", "-m", "labkit.launch", "probe", str(spec.resolve())]
    env = python_on_path({k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}, logs / ".bin")
    env.setdefault("GLOG_v", "3")
    env.setdefault("MS_OM_PATH", str(logs.resolve()))
    with open(logs / "msrun.log", "w", encoding="utf-8") as sink:
        root = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job = Job(root, False, 0)
    try:
        deadline = time.perf_counter() + timeout
        while root.poll() is None and time.perf_counter() < deadline:
            time.sleep(POLL_S)
            job.refresh()
            if MSRUN_WORKER_ERROR.search(read_log(logs / "msrun.log")) or result_file.exists():
                break
        time.sleep(0.5)
    finally:
        job.kill_all()
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
    import statistics

    import numpy as np

    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    rank, size = get_rank(), get_group_size()
    from labkit.parallel import context as parallel

    parallel.set_parallel_context("data_parallel", device_num=size, init_communication=False)
    align_op = ops.AllReduce()

    @ms.jit
    def align(x):
        return align_op(x)

    one = ms.Tensor([1.0], ms.float32)

    def timed(shapes):
        params = ms.ParameterTuple(ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
                                   for i, s in enumerate(shapes))
        reducer = nn.DistributedGradReducer(params, mean=True, degree=size)
        grads = tuple(ms.Tensor(np.full(s, rank + 1.0, np.float32)) for s in shapes)

        @ms.jit
        def run(g):
            return reducer(g)

        check = float(run(grads)[0].asnumpy().ravel()[0])  # compile + warm-up; mean of 1..size
        seconds = []
        for _ in range(spec["repeats"]):
            align(one).asnumpy()
            t = time.perf_counter()
            res = run(grads)
            res[-1].asnumpy()
            seconds.append(time.perf_counter() - t)
        numel = int(sum(np.prod(s) for s in shapes))
        med = statistics.median(seconds)
        return {"tensors": len(shapes), "numel": numel, "mbytes": numel * 4 / 1e6, "median_s": med,
                "min_s": min(seconds), "algbw_gbps": numel * 4 / med / 1e9,
                "mean_ok": abs(check - (size + 1) / 2) < 1e-6}

    model = timed([tuple(s) for s in spec["model"]])
    sweep = [timed([(int(n),)]) for n in spec["sizes"]]
    if rank == 0:
        from mindspore.communication import GlobalComm

        from labkit.io import atomic_write_text

        libs = _loaded_libraries()
        atomic_write_text(spec["result"], json.dumps({
            "workers": size, "backend": str(GlobalComm.BACKEND), "model_grads": model, "sizes": sweep,
            "loaded_libraries": [p.name for p in libs],
            "env_readers": {v: _libraries_mentioning(libs, v) for v in spec.get("env_vars", [])}}))
    align(one).asnumpy()
