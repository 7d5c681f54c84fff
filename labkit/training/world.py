"""The process's place in a job: MindSpore's context for the device and parallel mode, the data-parallel size and
rank, the batch arithmetic (micro_batch x dp x accum = global_batch), and the few host-side collectives the
trainer needs outside the step graph (loss averaged over ranks, a barrier)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from labkit.config import RunConfig
from labkit.errors import LabkitError
from labkit.parallel import context as parallel


@dataclass
class World:
    rank: int = 0
    size: int = 1
    mode: str = "stand_alone"


def init_context(cfg: RunConfig) -> World:
    import mindspore as ms

    p = cfg.parallel
    ms.set_context(mode=ms.GRAPH_MODE if cfg.train.mode == "graph" else ms.PYNATIVE_MODE)
    try:
        ms.set_device(p.device_target)
    except RuntimeError as e:  # the runtime already started (any op ran): fine if it runs on the same target
        current = ms.get_context("device_target")
        if current != p.device_target:
            raise LabkitError(f"this process already runs MindSpore on {current}; parallel.device_target "
                              f"{p.device_target} cannot be chosen any more ({e})",
                              "start a fresh process (or kernel) for a run on another device") from None
    ms.set_seed(cfg.train.seed)
    launched = int(os.environ.get("MS_WORKER_NUM", "0") or 0)
    mode = p.parallel_mode or ("data_parallel" if launched > 1 else "stand_alone")
    if mode == "stand_alone":
        return World()

    if not launched:
        raise LabkitError(f"parallel_mode {mode} needs worker processes started by msrun",
                          "start the run with `labkit launch --workers N ...`")
    parallel.require_hardware(mode, p.device_target, launched)
    from mindspore.communication import get_group_size, get_rank, init

    init()
    world = World(get_rank(), get_group_size(), mode)
    parallel.set_parallel_context(dataclasses.replace(p, parallel_mode=mode), device_num=world.size,
                                  strategy_ckpt_path=str(Path(cfg.output_dir) / "strategy.ckpt"), gradients_mean=True)
    return world


def dp_size(cfg: RunConfig, world: World) -> int:
    if world.mode == "data_parallel":
        if cfg.parallel.dp not in (None, world.size):
            raise LabkitError(f"parallel.dp = {cfg.parallel.dp} but {world.size} workers run data parallel",
                              "leave parallel.dp unset or equal to the worker count")
        return world.size
    if world.mode == "stand_alone":
        return 1
    p = cfg.parallel
    return p.dp or world.size // (p.mp * p.pp * p.cp)


def check_batch(cfg: RunConfig, dp: int) -> int:
    t = cfg.train
    g = t.micro_batch * dp * t.accum
    if t.global_batch is not None and t.global_batch != g:
        raise LabkitError(
            f"train.global_batch = {t.global_batch} but micro_batch {t.micro_batch} x dp {dp} x accum {t.accum} = {g}",
            f"set train.accum = {t.global_batch // (t.micro_batch * dp)} or change global_batch to {g}"
            if t.global_batch % (t.micro_batch * dp) == 0 else
            f"make global_batch a multiple of micro_batch x dp = {t.micro_batch * dp}, or change it to {g}")
    return g


def peak_memory_mb(device_target: str) -> float:
    if device_target != "CPU":
        import mindspore as ms

        return ms.runtime.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_ALL_REDUCE = []


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over all ranks. MindSpore 2.9's PyNative collectives (`comm_func.all_reduce`,
    `comm_func.barrier`) have no CPU kernel ("Create kernelmod for op InnerCommAllReduce failed"), so this is a
    one-op graph around `ops.AllReduce` (compiled once, ~0.02 s per call on CPU)."""
    import mindspore as ms
    from mindspore import ops

    if not _ALL_REDUCE:
        op = ops.AllReduce()

        @ms.jit
        def reduce(x):
            return op(x)

        _ALL_REDUCE.append(reduce)
    return [float(v) for v in _ALL_REDUCE[0](ms.Tensor(values, ms.float32)).asnumpy()]


def mean_over_ranks(value: float) -> float:
    from mindspore.communication import get_group_size

    return all_reduce_sum([value])[0] / get_group_size()


def barrier():
    """Every rank waits here until all have arrived (an all-reduce completes only when every rank joined it)."""
    all_reduce_sum([0.0])
