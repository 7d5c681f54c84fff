"""Checkpoint file formats: bfloat16 bits like torch's, a streamed .ckpt byte-equal to MindSpore's own."""
from __future__ import annotations

import numpy as np

from labkit.weights import formats as ckpt_io


def test_bf16_rounding_matches_torch():
    import torch

    x = np.random.default_rng(0).normal(size=4096).astype(np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, np.nan, 3.0e38]
    ours = ckpt_io.cast(x, "float32", "bfloat16")
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours[3:], ref[3:]) and np.isnan(ckpt_io.as_float32(ours[2:3], "bfloat16")).all()
    assert np.array_equal(ours[:2], ref[:2])


def test_ckpt_writer_matches_mindspore_and_splits_big_tensors(tmp_path, monkeypatch):
    import mindspore as ms

    a = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    items = [("a", a, "float32"), ("b", a.astype(np.float16), "float16"),
             ("c", ckpt_io.cast(a, "float32", "bfloat16"), "bfloat16")]
    w = ckpt_io.CkptWriter(tmp_path / "mine.ckpt")
    for n, arr, dt in items:
        w.write(n, arr, dt)
    w.close()
    ms.save_checkpoint([{"name": "a", "data": ms.Tensor(a)}, {"name": "b", "data": ms.Tensor(a.astype(np.float16))},
                        {"name": "c", "data": ms.Tensor(a, dtype=ms.bfloat16)}], str(tmp_path / "ref.ckpt"))
    assert (tmp_path / "mine.ckpt").read_bytes() == (tmp_path / "ref.ckpt").read_bytes()
    monkeypatch.setattr(ckpt_io, "CKPT_CHUNK", 24)  # force several records per tensor
    w = ckpt_io.CkptWriter(tmp_path / "chunks.ckpt")
    w.write("a", a, "float32")
    w.close()
    idx = ckpt_io.ckpt_index(tmp_path / "chunks.ckpt")
    assert len(idx["a"].chunks) == 5 and np.array_equal(ckpt_io.read_ckpt_tensor(tmp_path / "chunks.ckpt", idx["a"]), a)
    assert np.array_equal(ms.load_checkpoint(str(tmp_path / "chunks.ckpt"))["a"].asnumpy(), a)


def test_nonfinite_counts_in_every_stored_dtype():
    from labkit.weights.formats import cast, nonfinite_counts

    f32 = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        assert nonfinite_counts(cast(f32, "float32", dtype), dtype) == (1, 2), dtype
        assert nonfinite_counts(cast(f32[[0, 4]], "float32", dtype), dtype) is None, dtype


def test_corrupt_safetensors_header_and_bad_json_are_named(tmp_path):
    import json
    import struct

    import pytest

    from labkit.errors import LabkitError
    from labkit.weights.formats import open_hf

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    body = b"{garbage that is not json}"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(LabkitError, match="model.safetensors has a corrupt safetensors header"):
        open_hf(tmp_path)
    (tmp_path / "config.json").write_text("{,}")
    with pytest.raises(LabkitError, match=r"config.json is not valid JSON"):
        open_hf(tmp_path)
