"""The one validator of run folders, datasets and resume (labkit.training.run_dir), in each caller's spelling."""
from __future__ import annotations

import json

import pytest

from labkit.config import load_run_config
from labkit.errors import LabkitError
from labkit.training import checkpoint, run_dir


def fake_checkpoint(out, step):
    d = checkpoint.checkpoint_dir(out) / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"kind": "full", "step": step}))
    (d / "state.ckpt").write_bytes(b"")
    return d


def test_step_of_and_the_newest_checkpoint(tmp_path):
    for step in (10, 2, 100):
        fake_checkpoint(tmp_path, step)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [2, 10, 100]
    with pytest.raises(LabkitError, match="not a checkpoint folder"):
        checkpoint.step_of(tmp_path / "final")


def test_run_folder_fresh_old_and_resumed(tmp_path):
    out = tmp_path / "run"
    assert run_dir.check_run_folder(out, resume=False, overwrite=False, steps=5).start_step == 0
    with pytest.raises(LabkitError, match="no complete checkpoint") as e:
        run_dir.check_run_folder(out, resume=True, overwrite=False, steps=5, shared=True)
    assert "every node shares" in e.value.fix
    fake_checkpoint(out, 4)
    with pytest.raises(LabkitError, match="already holds a run") as e:
        run_dir.check_run_folder(out, resume=False, overwrite=False, steps=5)
    assert "--resume" in e.value.fix and "--overwrite" in e.value.fix
    with pytest.raises(LabkitError, match="already holds a run") as e:
        run_dir.check_run_folder(out, resume=False, overwrite=False, steps=5, spelling=run_dir.PAPERMILL)
    assert "-p resume True" in e.value.fix and "-p overwrite True" in e.value.fix
    assert not run_dir.check_run_folder(out, resume=False, overwrite=True, steps=5).resume
    folder = run_dir.check_run_folder(out, resume=True, overwrite=False, steps=5)
    assert (folder.start_step, folder.checkpoint.name, folder.output) == (4, "step_000004", out.resolve())
    with pytest.raises(LabkitError, match="already at train.steps 4"):
        run_dir.check_run_folder(out, resume=True, overwrite=False, steps=4)


def test_dataset_must_fit_the_config(tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "stats.json").write_text(json.dumps({"format": "labkit-dataset/1", "seq_len": 64, "vocab_size": 100,
                                               "n_samples": 10, "files": {}}))
    cfg = load_run_config("configs/tiny_cpu.yaml", [f"data.dataset={ds}"])
    with pytest.raises(LabkitError, match="seq_len 64, the config asks for 128"):
        run_dir.check_dataset(cfg)
    cfg = load_run_config("configs/tiny_cpu.yaml", [f"data.dataset={tmp_path / 'none'}"])
    with pytest.raises(LabkitError, match="not found") as e:
        run_dir.check_dataset(cfg)
    assert "labkit data build" in e.value.fix
    assert run_dir.check_init_checkpoint(None) is None
    with pytest.raises(LabkitError, match="init_checkpoint"):
        run_dir.check_init_checkpoint(tmp_path / "no.ckpt")
