"""MindSpore's parallel modes, set up for real, with a clear refusal where the hardware cannot run them.

- data_parallel: every device holds the whole model; gradients are all-reduced. Runs on CPU (msrun, mccl).
- semi_auto_parallel: mindformers' built-in shard strategies from its `parallel_config` (dp/mp/pp), MindSpore
  inserts the collectives. Ascend or GPU, at least 2 devices.
- auto_parallel: MindSpore searches the operator strategies itself (`sharding_propagation` from a few annotated
  operators, or `recursive_programming` over the whole graph) and saves them to a strategy checkpoint, which
  `summarize_strategy` reads. Ascend or GPU, at least 2 devices.
MindSpore 2.9 refuses the last two on CPU ("Invalid communication backend: CPU for semi_auto_parallel/
auto_parallel mode, currently only support Ascend/GPU backend"), so `require_hardware` stops before any launch.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from labkit.config import ParallelConfig
from labkit.errors import LabkitError

MODES = ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel")
OPERATOR_MODES = ("semi_auto_parallel", "auto_parallel")
SEARCH_MODES = ("sharding_propagation", "recursive_programming")
ACCELERATORS = ("Ascend", "GPU")


def require_hardware(parallel_mode: str, device_target: str, device_num: int) -> None:
    """Raise LabkitError when `parallel_mode` cannot run on `device_num` devices of `device_target`."""
    if parallel_mode not in MODES:
        raise LabkitError(f"parallel_mode '{parallel_mode}' is not known", f"use one of {', '.join(MODES)}")
    if parallel_mode not in OPERATOR_MODES:
        return
    if device_target not in ACCELERATORS:
        raise LabkitError(
            f"parallel_mode '{parallel_mode}' needs Ascend or GPU devices (at least 2); this run targets "
            f"{device_target}, where MindSpore 2.9 refuses it ('Invalid communication backend: {device_target} for "
            f"semi_auto_parallel/auto_parallel mode, currently only support Ascend/GPU backend')",
            "on CPU use parallel_mode: data_parallel (2+ msrun workers), or run this on >= 2 Ascend/GPU devices; "
            "`labkit plan` writes the parallel_config it would use, offline")
    if device_num < 2:
        raise LabkitError(f"parallel_mode '{parallel_mode}' needs at least 2 devices, got device_num={device_num}",
                          "start >= 2 workers (msrun --worker_num=N), or use stand_alone for one device")


def set_parallel_context(par: ParallelConfig, *, device_num: int, strategy_ckpt_path: str | None = None,
                         gradients_mean: bool = True, init_communication: bool = True,
                         extra: dict | None = None) -> dict:
    """Set MindSpore's auto-parallel context for a run's parallel settings (its parallel_mode, search_mode,
    optimizer_shard, pp and device_target; the real calls) and return what was set.

    Call it in every worker after `mindspore.set_context(device_target=...)`. With init_communication, it calls
    `mindspore.communication.init()` (hccl on Ascend, nccl on GPU, mccl on CPU) unless already done.
    extra: further `set_auto_parallel_context` keys (e.g. full_batch, dataset_strategy)."""
    import mindspore as ms

    parallel_mode, search_mode, device_target = par.parallel_mode, par.search_mode, par.device_target
    enable_parallel_optimizer, pipeline_stages = par.optimizer_shard, par.pp
    require_hardware(parallel_mode, device_target, device_num)
    if search_mode not in SEARCH_MODES:
        raise LabkitError(f"search_mode '{search_mode}' is not known", f"use {' or '.join(SEARCH_MODES)}")
    if pipeline_stages < 1 or (pipeline_stages > 1 and parallel_mode not in OPERATOR_MODES):
        raise LabkitError(f"pipeline_stages={pipeline_stages} needs semi_auto_parallel or auto_parallel",
                          "set pipeline_stages: 1 for data_parallel")
    if enable_parallel_optimizer and device_target not in ACCELERATORS:
        raise LabkitError("the parallel optimizer (optimizer sharding) runs on Ascend/GPU only",
                          "set enable_parallel_optimizer / optimizer_shard: false on CPU")
    ms.reset_auto_parallel_context()
    if parallel_mode == "stand_alone":
        return {"parallel_mode": "stand_alone", "device_num": 1}
    if init_communication:
        from mindspore.communication import GlobalComm, init

        if not GlobalComm.INITED:
            init()
    settings = {"parallel_mode": parallel_mode, "device_num": device_num, "gradients_mean": gradients_mean}
    if parallel_mode in OPERATOR_MODES:
        settings["enable_parallel_optimizer"] = enable_parallel_optimizer
        settings["pipeline_stages"] = pipeline_stages
        if parallel_mode == "auto_parallel":
            settings["search_mode"] = search_mode
        if strategy_ckpt_path:
            Path(strategy_ckpt_path).parent.mkdir(parents=True, exist_ok=True)
            settings["strategy_ckpt_config"] = {"save_file": str(strategy_ckpt_path), "only_trainable_params": False}
    settings.update(extra or {})
    ms.set_auto_parallel_context(**settings)
    return settings


def summarize_strategy(strategy_ckpt_path: str | Path) -> dict:
    """Read a MindSpore strategy checkpoint (protobuf, or .json) and summarise the per-operator shard strategies
    and the parameter layouts: how many operators of each type got which strategy, which parameters are split."""
    path = Path(strategy_ckpt_path)
    if not path.is_file():
        raise LabkitError(f"strategy checkpoint {path} not found",
                          "it is written by a semi_auto/auto_parallel run with strategy_ckpt_path set")
    ops, layouts, stage = _read_strategy(path)
    by_type: dict[str, Counter] = {}
    split_ops = 0
    for node, strategies in ops.items():
        op_type = _op_type(node)
        key = "x".join("(" + ",".join(map(str, s)) + ")" for s in strategies)
        by_type.setdefault(op_type, Counter())[key] += 1
        split_ops += any(d > 1 for s in strategies for d in s)
    params = {}
    for name, lay in layouts.items():
        dev, tmap = lay.get("dev_matrix", []), lay.get("tensor_map", [])
        # tensor_map counts device-matrix axes from the right; -1 = not split along that tensor dimension
        splits = [dev[-1 - m] if 0 <= m < len(dev) else 1 for m in tmap]
        params[name] = {"dev_matrix": dev, "tensor_map": tmap, "splits": splits,
                        "optimizer_shard": lay.get("opt_weight_shard_size", 0)}
    return {
        "file": str(path), "current_stage": stage, "operators": len(ops), "split_operators": split_ops,
        "by_operator_type": {t: dict(c.most_common()) for t, c in sorted(by_type.items())},
        "parameters": len(params), "split_parameters": sum(any(s > 1 for s in p["splits"]) for p in params.values()),
        "layouts": params,
    }


def _read_strategy(path: Path) -> tuple[dict, dict, int]:
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise LabkitError(f"{path} is not valid JSON: {e}") from None
        ops = {name: item.get("parallel_strategy", []) for name, item in data.get("parallel_strategy_item", {}).items()}
        return ops, dict(data.get("parallel_layout_item", {})), int(data.get("current_stage", 0))
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    pb = ParallelStrategyMap()
    try:
        pb.ParseFromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise LabkitError(f"{path} is not a MindSpore strategy checkpoint: {e}",
                          "pass the file named in strategy_ckpt_config save_file (.ckpt protobuf or .json)") from None
    ops = {it.node_name: [list(s.dim) for s in it.parallel_strategys.parallel_strategy]
           for it in pb.parallel_strategy_item}
    layouts = {}
    for it in pb.parallel_layout_item:
        lay = it.parallel_layouts
        layouts[it.param_name] = {"dev_matrix": list(lay.dev_matrix[0].dim) if lay.dev_matrix else [],
                                  "tensor_map": list(lay.tensor_map[0].dim) if lay.tensor_map else [],
                                  "opt_weight_shard_size": lay.opt_weight_shard_size}
    return ops, layouts, pb.current_stage


def _op_type(node_name: str) -> str:
    """'Default/network-.../MatMul-op12' -> 'MatMul'."""
    last = node_name.rsplit("/", 1)[-1]
    m = re.match(r"([A-Za-z][A-Za-z0-9_]*?)(?:-op\d+|_\d+)?$", last)
    return m.group(1) if m else last
