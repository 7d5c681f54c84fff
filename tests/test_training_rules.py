"""What the trainer promises beyond the equivalences: the in-graph schedule the optimizer uses is the formula the
course teaches, checkpoint rotation keeps the newest K, and an O2 overflow skips the update and halves the scale."""
import numpy as np
import pytest

from labkit.config import load_run_config
from labkit.training import checkpoint
from labkit.training.schedule import WarmupCosine, lr_at


@pytest.mark.parametrize("sets", [
    ["train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=10", "train.decay_steps=40"],
    ["train.lr=3e-3", "train.min_lr=0", "train.warmup_steps=0", "train.decay_steps=25"],
])
def test_in_graph_schedule_equals_lr_at_at_every_step(sets):
    """WarmupCosine runs inside the optimizer's graph; lr_at is what metrics.jsonl logs and notebook 04a plots."""
    import mindspore as ms

    t = load_run_config("configs/tiny_cpu.yaml", sets).train
    sched = WarmupCosine(t)
    steps = range(t.decay_steps + 5)  # through warmup, the cosine and the floor after it
    graph = [float(sched(ms.Tensor(s, ms.int32)).asnumpy()) for s in steps]
    host = [lr_at(s, t) for s in steps]
    # The graph evaluates the formula in float32, whose terms are of size lr: each may round by half an ulp of
    # lr (float32 eps 1.2e-7), and 1 + cos(pi p) cancels near the end of the cosine, so the error is absolute.
    ulp = float(np.finfo(np.float32).eps) * t.lr
    worst = max(abs(a - b) for a, b in zip(graph, host))
    assert worst <= 8 * ulp, f"in-graph schedule differs from lr_at by {worst:.3g} (> 8 float32 ulps of lr)"


def test_rotation_keeps_the_newest_checkpoints(tmp_path):
    import mindspore as ms

    p = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="w")
    for step in (1, 2, 3, 4):
        p.set_data(ms.Tensor(np.full(3, step, np.float32)))
        checkpoint.save(tmp_path, step, [("w", p)], {}, keep=2)
    kept = checkpoint.list_checkpoints(tmp_path)
    assert [c.name for c in kept] == ["step_000003", "step_000004"]
    params, meta = checkpoint.load_full(checkpoint.latest(tmp_path))
    assert meta["step"] == 4 and params["w"].asnumpy().tolist() == [4.0, 4.0, 4.0]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "no half-written folder left behind"


@pytest.mark.slow
def test_o2_overflow_skips_the_update_and_halves_the_scale(tmp_path):
    """A loss scale of 2^40 makes float16 gradients overflow (fp16 max 65504): the step must change no weight,
    count the overflow and halve the scale, until the scale is small enough for a real update."""
    from labkit.training.trainer import Trainer

    cfg = load_run_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", "train.amp_level=O2",
                                                    f"train.loss_scale={2.0 ** 40}", "train.scale_factor=2",
                                                    "train.steps=2", "train.micro_batch=2", "train.save_every=0",
                                                    "train.peak_tflops=0.1", "model.num_layers=1"])  # any depth does
    tr = Trainer(cfg)
    before = {n: p.asnumpy().copy() for n, p in tr.model.parameters_and_names()}
    tr.run()
    recs = tr.history
    assert [r["overflow"] for r in recs] == [True, True] and recs[-1]["overflows"] == 2
    assert recs[1]["loss_scale"] == recs[0]["loss_scale"] / 2
    after = {n: p.asnumpy() for n, p in tr.model.parameters_and_names()}
    assert all(np.array_equal(before[n], after[n]) for n in before), "an overflowed step must not update weights"
