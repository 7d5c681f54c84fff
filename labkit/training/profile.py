"""Where a training step's time goes: a top-operators table per framework, from each framework's own profiler.

MindSpore: `mindspore.profiler.Profiler` around a few steady steps of labkit's Trainer (after the warm-up steps the
throughput figures skip too); its `cpu_op_type_info_*.csv` sums time by operator type. PyTorch: `torch.profiler`
around a few steps of any step function, self CPU time by operator. Both tables give milliseconds per step and the
share of all operator time; they answer "which operators to fuse or replace", not "how long is a step" (profiling
slows a step, and operator times overlap across threads).
"""
from __future__ import annotations

import csv
import tempfile
from pathlib import Path

from labkit.training.metrics import WARMUP_STEPS


def table(times_ms: dict[str, float], steps: int, top: int = 15) -> list[dict]:
    """Rows {op, ms_per_step, share}, largest first."""
    total = sum(times_ms.values()) or 1.0
    rows = sorted(times_ms.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": op, "ms_per_step": ms / steps, "share": ms / total} for op, ms in rows]


# What a learner should read from an operator table: matrix products do the model's FLOPs (6·N per token); on a
# small model on a CPU the element-wise kernels, reductions (norms, softmax, loss) and the optimizer's per-parameter
# update take a large share too, which no FLOP count sees. Operator types by group (MindSpore's CPU names).
OP_GROUPS = {
    "matmul": ("MatMul", "BatchMatMul", "Dense", "MatMulExt", "BatchMatMulExt"),
    "optimizer": ("AdamWeightDecay", "Adam", "AdamW", "ApplyAdamWithAmsgrad", "FusedAdamWeightDecay"),
    "reduction / softmax / loss": ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "Softmax", "LogSoftmax",
                                   "SoftmaxGrad", "LogSoftmaxGrad", "SparseSoftmaxCrossEntropyWithLogits",
                                   "CrossEntropy", "ArgMax", "Argmax", "CumSum", "RmsNorm", "RmsNormGrad"),
    "data movement": ("Transpose", "Reshape", "Concat", "Gather", "GatherV2", "StridedSlice", "StridedSliceGrad",
                      "Tile", "BroadcastTo", "Cast", "ExpandDims", "Squeeze", "Split", "Slice", "TensorCopySlices",
                      "UnsortedSegmentSum", "ScatterNd", "Identity", "TensorMove", "Assign", "OneHot", "Select"),
    "element-wise": ("Mul", "Add", "Sub", "Div", "RealDiv", "Neg", "Sigmoid", "SigmoidGrad", "SiLU", "SiLUGrad",
                     "Square", "Sqrt", "Rsqrt", "RsqrtGrad", "Exp", "Log", "Pow", "Maximum", "Minimum", "AddN",
                     "Sin", "Cos", "Abs", "Sign", "Reciprocal", "Erf", "Tanh", "IsFinite", "Less", "Greater",
                     "Equal", "LessEqual", "GreaterEqual", "LogicalAnd", "LogicalNot", "Floor", "FloorDiv",
                     "AddExt", "SubExt", "Muls", "Adds", "ZerosLike", "OnesLike", "Fill", "Fills"),
}


def op_groups(times_ms: dict[str, float], steps: int) -> list[dict]:
    """Rows {group, ms_per_step, share, ops} over OP_GROUPS, largest first; unlisted operator types are "other"."""
    of = {op: group for group, ops in OP_GROUPS.items() for op in ops}
    sums: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for op, ms in times_ms.items():
        g = of.get(op, "other")
        sums[g] = sums.get(g, 0.0) + ms
        members.setdefault(g, []).append(op)
    total = sum(sums.values()) or 1.0
    return [{"group": g, "ms_per_step": ms / steps, "share": ms / total,
             "ops": ", ".join(sorted(members[g], key=lambda o: -times_ms[o])[:6])}
            for g, ms in sorted(sums.items(), key=lambda kv: -kv[1])]


def mindspore_op_times(folder) -> dict[str, float]:
    """Total milliseconds by operator type from a MindSpore CPU profile folder."""
    times: dict[str, float] = {}
    for f in Path(folder).rglob("cpu_op_type_info_*.csv"):
        with open(f, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                times[row["op_type"]] = times.get(row["op_type"], 0.0) + float(row["total_compute_time"])
    return times


def profile_labkit(preset: str, micro_batch: int, seq_len: int, kernels: str = "native", steps: int = 3,
                   warmup: int = WARMUP_STEPS, config: str = "configs/tiny_cpu.yaml") -> list[dict]:
    """Top operators of labkit's MindSpore training step (float32, no accumulation) over `steps` steady steps."""
    from labkit.config import load_run_config
    from labkit.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="labkit_profile_") as tmp:
        cfg = load_run_config(config, [
            f"model.preset={preset}", f"output_dir={tmp}/run", f"train.steps={warmup}", "train.accum=1",
            f"train.micro_batch={micro_batch}", f"data.seq_len={seq_len}", "train.save_every=0",
            "train.peak_tflops=1", "train.amp_level=O0", f"train.kernels={kernels}"])
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.run()  # compile and warm-up, outside the profile
        return profile_trainer(trainer, steps)["table"]


def profile_trainer(trainer, steps: int = 3, top: int = 15) -> dict:
    """Profile `steps` more steps of a Trainer that has already run (so its graph is compiled and warm): the top
    operators `table`, every operator's total milliseconds (`times_ms`), and the `history` rows of those steps.
    The trainer's train.steps is raised by `steps`; its run folder gets those rows as usual."""
    from mindspore.profiler import Profiler

    with tempfile.TemporaryDirectory(prefix="labkit_profile_") as tmp:
        trainer.cfg.train.steps = trainer.step + steps
        prof = Profiler(output_path=f"{tmp}/profile")
        trainer.run()
        prof.stop()
        prof.analyse()
        times = mindspore_op_times(f"{tmp}/profile")
    return {"table": table(times, steps, top), "times_ms": times, "steps": steps,
            "history": trainer.history[-steps:]}


def profile_torch(step, steps: int = 3) -> list[dict]:
    """Top operators (self CPU time) of `steps` calls of `step()` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    times = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return table(times, steps)
