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

from labkit.config import load_run_config
from labkit.training.metrics import WARMUP_STEPS
from labkit.training.trainer import Trainer


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
    # labkit's C++ operators (train.kernels: custom); MindSpore names every one "Custom", so the optimizer's update
    # (labkit.model.kernels.adamw) is counted here, not under "optimizer"
    "custom kernels (AdamW incl.)": ("Custom",),
}


# The same groups for PyTorch's operator names (aten::<name>, self CPU time). PyTorch fuses attention on CPU into one
# kernel (scaled-dot-product attention: the two matmuls and the softmax), its own group; MindSpore's attention shows
# as BatchMatMul plus the softmax's element-wise and reduction kernels.
TORCH_OP_GROUPS = {
    "matmul": ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear"),
    "attention (fused)": ("_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "optimizer": ("_fused_adamw_", "_fused_adamw", "_foreach_mul_", "_foreach_add_", "_foreach_addcmul_",
                  "_foreach_addcdiv_", "_foreach_sqrt", "_foreach_div_", "_foreach_lerp_", "_foreach_mul",
                  "_foreach_div", "_foreach_add", "_foreach_norm", "_foreach_sub", "_foreach_neg"),
    "reduction / softmax / loss": ("sum", "mean", "max", "amax", "norm", "linalg_vector_norm", "_log_softmax",
                                   "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
                                   "nll_loss2d_forward", "_softmax", "_softmax_backward_data", "logsumexp",
                                   "cross_entropy_loss", "log_softmax", "nll_loss", "nll_loss_nd"),
    "data movement": ("copy_", "cat", "index", "index_select", "embedding_dense_backward", "transpose", "clone",
                      "_to_copy", "to", "contiguous", "fill_", "zero_", "empty", "empty_strided", "slice",
                      "select", "expand", "view", "reshape", "as_strided", "stack", "index_put_", "scatter_add_",
                      "_unsafe_view", "t", "permute", "unsqueeze", "squeeze", "masked_fill", "masked_fill_",
                      "detach", "ones_like", "empty_like", "zeros_like", "resolve_conj", "resolve_neg"),
    "element-wise": ("mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "neg", "pow", "rsqrt", "sqrt",
                     "exp", "silu", "silu_backward", "sigmoid", "cos", "sin", "reciprocal", "clamp", "clamp_min",
                     "where", "lt", "gt", "eq", "ne", "ge", "le", "abs", "mul_scalar", "lerp_", "addcmul_",
                     "addcdiv_", "tanh", "pow_", "sqrt_", "minimum", "maximum"),
}


AUTOGRAD = "autograd bookkeeping"


def mindspore_group(op: str) -> str:
    return _MS_OF.get(op, "other")


def torch_group(op: str) -> str:
    if op.startswith("Optimizer."):  # anything run inside optimizer.step() / zero_grad() (see profile_torch)
        return "optimizer"
    if op.startswith("autograd::") or op.endswith(("Backward0", "Backward1", "AccumulateGrad")):
        return AUTOGRAD  # eager PyTorch walks its tape at run time; MindSpore compiles the backward into the graph
    return _TORCH_OF.get(op.split("::", 1)[-1], "other")


_MS_OF = {op: group for group, ops in OP_GROUPS.items() for op in ops}
_TORCH_OF = {op: group for group, ops in TORCH_OP_GROUPS.items() for op in ops}


def op_groups(times_ms: dict[str, float], steps: int, group_of=mindspore_group) -> list[dict]:
    """Rows {group, ms_per_step, share, ops} by `group_of` (MindSpore's names by default, `torch_group` for
    PyTorch's), largest first; unlisted operator types are "other"."""
    sums: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for op, ms in times_ms.items():
        g = group_of(op)
        sums[g] = sums.get(g, 0.0) + ms
        members.setdefault(g, []).append(op)
    total = sum(sums.values()) or 1.0
    return [{"group": g, "ms_per_step": ms / steps, "share": ms / total,
             "ops": ", ".join(sorted(members[g], key=lambda o: -times_ms[o])[:6])}
            for g, ms in sorted(sums.items(), key=lambda kv: -kv[1])]


def account(mindspore: dict, torch: dict) -> list[dict]:
    """Where MindSpore's step loses to PyTorch's, group by group: rows {group, mindspore_ms, torch_ms, gap_ms}
    (milliseconds per step, gap = MindSpore - PyTorch), largest gap first, then a "total" row. Each argument is a
    profile {"times_ms": {op: total ms}, "steps": n} as `profile_labkit` / `profile_torch` return it."""
    ms_rows = {r["group"]: r for r in op_groups(mindspore["times_ms"], mindspore["steps"])}
    pt_rows = {r["group"]: r for r in op_groups(torch["times_ms"], torch["steps"], torch_group)}
    rows = []
    for g in set(ms_rows) | set(pt_rows):
        a, b = ms_rows.get(g, {}), pt_rows.get(g, {})
        rows.append({"group": g, "mindspore_ms": a.get("ms_per_step", 0.0), "torch_ms": b.get("ms_per_step", 0.0),
                     "mindspore_ops": a.get("ops", ""), "torch_ops": b.get("ops", "")})
    for r in rows:
        r["gap_ms"] = r["mindspore_ms"] - r["torch_ms"]
    rows.sort(key=lambda r: -r["gap_ms"])
    total = {k: sum(r[k] for r in rows) for k in ("mindspore_ms", "torch_ms", "gap_ms")}
    return rows + [{"group": "total", **total, "mindspore_ops": "", "torch_ops": ""}]


def mindspore_op_times(folder) -> dict[str, float]:
    """Total milliseconds by operator type from a MindSpore CPU profile folder."""
    times: dict[str, float] = {}
    for f in Path(folder).rglob("cpu_op_type_info_*.csv"):
        with open(f, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                times[row["op_type"]] = times.get(row["op_type"], 0.0) + float(row["total_compute_time"])
    return times


def profile_labkit(preset: str, micro_batch: int, seq_len: int, kernels: str = "native", steps: int = 3,
                   warmup: int = WARMUP_STEPS, config: str = "configs/tiny_cpu.yaml") -> dict:
    """Profile of labkit's MindSpore training step (float32, no accumulation) over `steps` steady steps:
    {table, times_ms, steps} (see `profile_trainer`)."""
    with tempfile.TemporaryDirectory(prefix="labkit_profile_") as tmp:
        cfg = load_run_config(config, [
            f"model.preset={preset}", f"output_dir={tmp}/run", f"train.steps={warmup}", "train.accum=1",
            f"train.micro_batch={micro_batch}", f"data.seq_len={seq_len}", "train.save_every=0",
            "train.peak_tflops=1", "train.amp_level=O0", f"train.kernels={kernels}"])
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.run()  # compile and warm-up, outside the profile
        prof = profile_trainer(trainer, steps)
        return {k: prof[k] for k in ("table", "times_ms", "steps")}


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


def profile_torch(step, steps: int = 3) -> dict:
    """Profile (self CPU time by operator) of `steps` calls of `step()` under torch.profiler: {table, times_ms,
    steps}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    times: dict[str, float] = {}
    for e in prof.events():  # PyTorch's AdamW on CPU runs as plain mul_/lerp_/addcdiv_ kernels: keep them apart
        if e.self_cpu_time_total <= 0:
            continue
        key, parent = e.name, e.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                key = f"{parent.name.split('#')[0]}/{e.name}"
                break
            parent = parent.cpu_parent
        times[key] = times.get(key, 0.0) + e.self_cpu_time_total / 1e3
    return {"table": table(times, steps), "times_ms": times, "steps": steps}
