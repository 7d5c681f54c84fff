"""Every training run writes TensorBoard event files beside metrics.jsonl, read back with TensorBoard's own reader."""
import math

import pytest

from labkit.training.tensorboard import EventWriter, event_files, read_scalars


def test_written_scalars_read_back_with_tensorboards_reader(tmp_path):
    rows = [{"step": s, "loss": 8.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5, "overflow": False} for s in (1, 2, 3)]
    rows.append({"step": 4, "loss": float("nan"), "lr": 4e-3})  # a non-finite value is skipped, not written
    rows[1].update(val_loss=7.5, val_ppl=math.exp(7.5))  # an evaluation step
    w = EventWriter(tmp_path)
    for r in rows:
        w.add(r)
    w.close()
    got = read_scalars(tmp_path)
    assert set(got) == {"loss", "lr", "grad_norm", "val_loss", "val_ppl"}  # booleans and missing keys are not scalars
    assert got["val_loss"] == [(2, pytest.approx(7.5))]
    assert [s for s, _ in got["loss"]] == [1, 2, 3]
    assert [v for _, v in got["loss"]] == pytest.approx([8.0, 4.0, 8.0 / 3], rel=1e-6)  # float32 in the file
    assert [s for s, _ in got["lr"]] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_training_run_writes_events_beside_metrics(tmp_path):
    from labkit.config import load_run_config
    from labkit.training.metrics import read_metrics
    from labkit.training.trainer import train

    cfg = load_run_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=3", "train.save_every=0",
                                                    "train.peak_tflops=1", "model.num_layers=1"])  # events, not depth
    train(cfg)
    rows = read_metrics(tmp_path)
    assert len(event_files(tmp_path)) == 1 and (tmp_path / "metrics.jsonl").is_file()
    got = read_scalars(tmp_path)
    assert [s for s, _ in got["loss"]] == [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "rss_mb"):
        assert all(math.isclose(v, r[key], rel_tol=1e-6) for (_, v), r in zip(got[key], rows)), key
    assert all(r["rss_mb"] > 100 for r in rows)  # a process with MindSpore loaded holds well over 100 MB resident
