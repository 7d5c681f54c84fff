"""Framework parallel modes: refused on CPU before anything launches, set for real where they can run, and
strategy checkpoints summarised (from files written here in MindSpore's own formats)."""
from __future__ import annotations

import json

import pytest

from labkit.config import ParallelConfig
from labkit.errors import LabkitError
from labkit.parallel.context import require_hardware, set_parallel_context, summarize_strategy


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_operator_modes_refused_on_cpu(mode):
    with pytest.raises(LabkitError) as e:
        require_hardware(mode, "CPU", 8)
    assert "Ascend or GPU" in e.value.what and "at least 2" in e.value.what
    assert "data_parallel" in e.value.fix
    with pytest.raises(LabkitError, match="at least 2 devices"):
        require_hardware(mode, "GPU", 1)
    require_hardware(mode, "Ascend", 8)
    require_hardware(mode, "GPU", 2)


def test_data_parallel_and_stand_alone_allowed_on_cpu():
    require_hardware("data_parallel", "CPU", 2)
    require_hardware("stand_alone", "CPU", 1)
    with pytest.raises(LabkitError, match="not known"):
        require_hardware("hybrid_parallel", "CPU", 2)


def test_set_parallel_context():
    import mindspore as ms

    ms.set_context(device_target="CPU")
    with pytest.raises(LabkitError, match="Ascend or GPU"):
        set_parallel_context(ParallelConfig("auto_parallel", search_mode="recursive_programming"), device_num=2)
    with pytest.raises(LabkitError, match="Ascend/GPU only"):
        set_parallel_context(ParallelConfig("data_parallel", optimizer_shard=True), device_num=2,
                             init_communication=False)
    with pytest.raises(LabkitError, match="pipeline_stages"):
        set_parallel_context(ParallelConfig("data_parallel", pp=2), device_num=2, init_communication=False)
    try:
        got = set_parallel_context(ParallelConfig("data_parallel"), device_num=2, init_communication=False)
        assert got == {"parallel_mode": "data_parallel", "device_num": 2, "gradients_mean": True}
        assert ms.get_auto_parallel_context("parallel_mode") == "data_parallel"
        assert ms.get_auto_parallel_context("gradients_mean") is True
    finally:
        ms.reset_auto_parallel_context()
    assert set_parallel_context(ParallelConfig("stand_alone"), device_num=1)["parallel_mode"] == "stand_alone"


NODES = {
    "Default/network-WithLossCell/_backbone-Net/dense1-Dense/MatMul-op0": [[2, 1], [4, 1]],
    "Default/network-WithLossCell/_backbone-Net/dense2-Dense/MatMul-op3": [[2, 4], [1, 4]],
    "Default/network-WithLossCell/_backbone-Net/ReLU-op1": [[2, 4]],
    "Default/network-WithLossCell/_loss_fn-SoftmaxCrossEntropyWithLogits/SoftmaxCrossEntropyWithLogits-op5":
        [[8, 1], [8, 1]],
}
LAYOUTS = {"dense1.weight": {"dev_matrix": [2, 4], "tensor_map": [0, -1], "opt_weight_shard_size": 0},
           "dense2.weight": {"dev_matrix": [2, 4], "tensor_map": [-1, 0], "opt_weight_shard_size": 0},
           "dense2.bias": {"dev_matrix": [8], "tensor_map": [-1], "opt_weight_shard_size": 0}}


def _check(summary):
    assert summary["operators"] == 4 and summary["split_operators"] == 4
    assert summary["by_operator_type"]["MatMul"] == {"(2,1)x(4,1)": 1, "(2,4)x(1,4)": 1}
    assert summary["by_operator_type"]["ReLU"] == {"(2,4)": 1}
    assert summary["parameters"] == 3 and summary["split_parameters"] == 2
    assert summary["layouts"]["dense1.weight"]["splits"] == [4, 1]  # row split over the last device axis (4)
    assert summary["layouts"]["dense2.bias"]["splits"] == [1]


def test_summarize_protobuf_strategy(tmp_path):
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    pb = ParallelStrategyMap()
    pb.current_stage = 0
    for name, strategies in NODES.items():
        item = pb.parallel_strategy_item.add()
        item.node_name = name
        item.parallel_strategys.stage = 0
        for s in strategies:
            item.parallel_strategys.parallel_strategy.add().dim.extend(s)
    for name, lay in LAYOUTS.items():
        item = pb.parallel_layout_item.add()
        item.param_name = name
        item.parallel_layouts.dev_matrix.add().dim.extend(lay["dev_matrix"])
        item.parallel_layouts.tensor_map.add().dim.extend(lay["tensor_map"])
        item.parallel_layouts.field = 0
        item.parallel_layouts.opt_weight_shard_step = 0
        item.parallel_layouts.opt_weight_shard_size = 0
    path = tmp_path / "strategy.ckpt"
    path.write_bytes(pb.SerializeToString())
    _check(summarize_strategy(path))


def test_summarize_json_strategy(tmp_path):
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps({
        "current_stage": 0,
        "parallel_strategy_item": {n: {"stage": 0, "parallel_strategy": s} for n, s in NODES.items()},
        "parallel_layout_item": {n: {**lay, "field": 0, "opt_weight_shard_step": 0} for n, lay in LAYOUTS.items()},
    }))
    _check(summarize_strategy(path))


def test_summarize_errors(tmp_path):
    with pytest.raises(LabkitError, match="not found"):
        summarize_strategy(tmp_path / "missing.ckpt")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\xff\x00not a protobuf")
    with pytest.raises(LabkitError, match="not a MindSpore strategy checkpoint"):
        summarize_strategy(bad)
