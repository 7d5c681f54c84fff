"""planner.layer_line: what one decoder layer adds to a strategy's memory per device, against the count by hand
(notebook 06c shows the same terms one by one)."""
import pytest

from labkit.config import model_preset
from labkit.parallel import planner


@pytest.mark.parametrize("optimizer_shard", [False, True])
def test_one_layer_by_hand(optimizer_shard):
    cfg = model_preset("llama2_7b")
    res = planner.plan(cfg, planner.Machine(8, 64), seq_len=4096, global_batch=64,
                       constraints=dict(dp=8, mp=1, pp=1, micro_batch=2, accum=4, recompute="none",
                                        optimizer_shard=optimizer_shard))
    row = res["strategies"][0]
    h, f, a, kv, s, b = cfg.hidden_size, cfg.ffn_size, cfg.num_heads, cfg.kv_heads * cfg.head_dim, 4096, 2
    mat, norms = 2 * h * h + 2 * h * kv + 3 * h * f, 2 * h  # the norms are float32 in mindformers' fp16 recipe
    shard = 8 if optimizer_shard else 1  # MindSpore's optimizer level1: weights and moments, not the norms
    line = planner.layer_line(cfg, res, row)
    assert line["weights"] == pytest.approx(2 * mat / shard + 4 * norms)
    assert line["gradients"] == pytest.approx(2 * mat + 4 * norms)  # accu_grads (accum 4), whole at level1
    assert line["optimizer"] == pytest.approx(8 * mat / shard + 8 * norms)
    assert line["copies"] == pytest.approx(2 * mat if optimizer_shard else 0)  # gathered float16 matrices
    acts = 4 * s * b * h + 2 * s * b * h + 2 * s * b * kv + 4 * s * b * f + 2 * a * s * b  # flash attention, fp16
    assert line["activations"] == pytest.approx(2 * acts)


def test_tensor_parallel_splits_the_layer():
    cfg = model_preset("llama2_7b")
    one, two = (planner.plan(cfg, planner.Machine(8, 64), seq_len=4096, global_batch=64,
                             constraints=dict(dp=8 // mp, mp=mp, pp=1, micro_batch=1, recompute="none",
                                              optimizer_shard=False)) for mp in (1, 2))
    l1, l2 = (planner.layer_line(cfg, r, r["strategies"][0]) for r in (one, two))
    norms = 2 * cfg.hidden_size * 4  # the two RMSNorm gains (float32) are not split
    assert l2["weights"] == pytest.approx((l1["weights"] - norms) / 2 + norms)
