"""Notebooks 08a and 08b's diagnoses that need no training run: the operator groups of a profile, the planner's
activation count the sequence-length lab compares with MindSpore's memory pool, and a difference judged against the
seed-to-seed spread."""
import pytest

from labkit.config import model_preset
from labkit.course.troubleshoot import beyond_seed_noise, planner_activations_mb
from labkit.training.profile import OP_GROUPS, op_groups, table


def test_op_groups_partition_the_operator_time():
    times = {"MatMul": 600.0, "BatchMatMul": 150.0, "Mul": 300.0, "AdamWeightDecay": 90.0, "ReduceSum": 60.0,
             "Transpose": 30.0, "SomethingNew": 15.0}
    rows = op_groups(times, steps=3)
    by = {r["group"]: r for r in rows}
    assert by["matmul"]["ms_per_step"] == pytest.approx(250.0) and by["matmul"]["ops"] == "MatMul, BatchMatMul"
    assert by["other"]["ops"] == "SomethingNew"
    assert sum(r["ms_per_step"] for r in rows) == pytest.approx(sum(times.values()) / 3)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [r["group"] for r in rows] == sorted(by, key=lambda g: -by[g]["ms_per_step"])
    # the table and the groups see the same total
    assert sum(r["ms_per_step"] for r in table(times, 3, top=99)) == pytest.approx(sum(times.values()) / 3)


def test_no_operator_type_is_in_two_groups():
    seen = [op for ops in OP_GROUPS.values() for op in ops]
    assert len(seen) == len(set(seen))


def test_at_equal_tokens_only_the_attention_scores_shrink():
    """seq 128 x micro-batch 8 against seq 64 x 16 (08a lab 4's short phase): the same tokens, so every linear term
    cancels and the difference is the float32 scores, heads x s x s per sample in every layer."""
    cfg = model_preset("tiny")
    diff = planner_activations_mb(cfg, 128, 8) - planner_activations_mb(cfg, 64, 16)
    scores = cfg.num_layers * cfg.num_heads * (128 * 128 * 8 - 64 * 64 * 16) * 4 / 2**20
    assert diff == pytest.approx(scores, rel=1e-9)
    assert planner_activations_mb(cfg, 128, 16) == pytest.approx(2 * planner_activations_mb(cfg, 128, 8), rel=1e-9)


def test_account_lines_up_the_two_frameworks_group_by_group():
    from labkit.training.profile import account, torch_group

    assert torch_group("aten::mm") == "matmul" and torch_group("aten::_fused_adamw_") == "optimizer"
    assert torch_group("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention (fused)"
    ms = {"times_ms": {"MatMul": 300.0, "Mul": 120.0, "ReduceSum": 60.0, "AdamWeightDecay": 30.0}, "steps": 3}
    pt = {"times_ms": {"aten::mm": 270.0, "aten::mul": 30.0, "aten::sum": 15.0, "aten::_fused_adamw_": 15.0,
                       "aten::_scaled_dot_product_flash_attention_for_cpu": 30.0}, "steps": 3}
    rows = account(ms, pt)
    by = {r["group"]: r for r in rows}
    assert by["element-wise"]["gap_ms"] == pytest.approx(30.0) and by["attention (fused)"]["gap_ms"] == pytest.approx(-10.0)
    assert rows[0]["group"] == "element-wise" and rows[-1]["group"] == "total"
    assert by["total"]["gap_ms"] == pytest.approx((510 - 360) / 3)


def test_torch_groups_cover_a_real_training_step():
    """A real torch.profiler run of a small training step (linear layers, SiLU, cross-entropy, clipping, AdamW):
    every name the profiler reports falls into a group, or the account would put it in "other". Which names appear
    is fixed by the step's code, not by how fast it ran, so the check is on names, not on time shares."""
    import torch

    from labkit.training.profile import op_groups, profile_torch, torch_group

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 512))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(256, 64), torch.randint(0, 512, (256,))

    def step():
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()

    step()
    prof = profile_torch(step, steps=3)
    rows = {r["group"]: r for r in op_groups(prof["times_ms"], prof["steps"], torch_group)}
    assert rows["matmul"]["ms_per_step"] > 0
    assert {"optimizer", "reduction / softmax / loss", "element-wise"} <= set(rows)
    unnamed = [op for op in prof["times_ms"] if torch_group(op) == "other"]
    assert not unnamed, f"operators in no group: {unnamed}"


def test_a_difference_counts_only_beyond_the_seed_spread():
    diff, spread, held = beyond_seed_noise([1.0, 1.1, 1.2], [2.0, 2.05, 2.1])
    assert held is True and diff == pytest.approx(-0.95) and spread == pytest.approx(0.2)
    assert beyond_seed_noise([2.0, 2.05, 2.1], [1.0, 1.1, 1.2])[2] is False
    diff, spread, held = beyond_seed_noise([1.0, 1.3], [1.1, 1.2])  # 0.0 apart, the seeds 0.3 apart
    assert held is None and spread == pytest.approx(0.3) and diff == pytest.approx(0.0)
    with pytest.raises(ValueError, match="two seeds"):
        beyond_seed_noise([1.0], [2.0, 2.1])
