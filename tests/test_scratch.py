"""The Llama written from MindSpore primitives (labkit.model.scratch) is mindformers' model: same initial weights
from the same seed, same logits and loss (padding included); and its tensor-parallel slices join back exactly."""
from __future__ import annotations

import numpy as np
import pytest

from labkit.config import model_preset
from labkit.errors import LabkitError
from labkit.model import scratch


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_loss_equal_mindformers(ms, tied):
    from labkit.model.llama import build_model

    cfg = model_preset("tiny", tie_word_embeddings=tied)
    s = 24
    model = build_model(cfg, seq_length=s, seed=7)
    weights = scratch.mindformers_weights(model)
    if not tied:  # the lab's init, drawn without mindformers, is the one build_model(seed=) applies
        mine = scratch.init(cfg, 7)
        assert sorted(mine) == sorted(weights)
        assert all(np.array_equal(mine[k], weights[k]) for k in mine)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, s + 1)).astype(np.int32)
    ids[0, 5] = ids[1, 0] = cfg.pad_token_id  # padding is masked as a key and in the loss, as mindformers does
    tokens, labels, mask = scratch.split_batch(ids, cfg.pad_token_id)
    p = scratch.parameters(weights, cfg)
    ours = scratch.logits(p, tokens, cfg).asnumpy()
    model.set_train(False)
    out = model(ms.Tensor(tokens.asnumpy()))
    theirs = (out[0] if isinstance(out, tuple) else out).asnumpy().reshape(ours.shape)
    # the same float32 operations in the same order: equal to rounding (bitwise on the machines measured)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    model.set_train(True)
    num, den = scratch.loss_terms(ms.Tensor(ours), labels, mask)
    assert float(num.asnumpy() / den.asnumpy()) == pytest.approx(float(model(ms.Tensor(ids)).asnumpy()), rel=1e-6)


def test_tensor_parallel_slices_join_back():
    cfg = model_preset("tiny")
    full = scratch.init(cfg, 0)
    for name in scratch.names(cfg):
        parts = [scratch.shard_array(name, full[name], scratch.Shard(tp_size=2, tp_rank=r)) for r in range(2)]
        assert np.array_equal(scratch.unshard(name, parts), full[name])
        if name.endswith(scratch.ROW_SPLIT + scratch.COL_SPLIT):
            assert parts[0].size * 2 == full[name].size
    with pytest.raises(LabkitError, match="does not divide num_kv_heads 4"):
        scratch.check_shard(cfg, scratch.Shard(tp_size=8))
    stage1 = scratch.names(cfg, scratch.Shard(first_layer=1))
    assert scratch.EMBED not in stage1 and scratch.HEAD in stage1 and not any(".layers.0." in n for n in stage1)


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=False, num_key_value_heads=4, rope_theta=5e5)])
def test_a_converted_hf_llama_gives_the_hf_logits(ms, tmp_path, variant):
    """The chain a team uses: an HF Llama, converted by the lab, loaded into the scratch model: the HF logits
    (GQA with a tied head, and MHA with an untied head and another RoPE base)."""
    from labkit.weights import convert, parity
    from labkit.weights.formats import as_float32, ckpt_index, read_ckpt_tensor
    from labkit.weights.hf_config import read_model_config

    hf = parity.make_hf_llama(tmp_path / "hf", seed=5, **variant)
    convert.hf2ms(hf, tmp_path / "ms")
    cfg = read_model_config(tmp_path / "ms")
    ckpt = tmp_path / "ms" / "model.ckpt"
    weights = {n: as_float32(read_ckpt_tensor(ckpt, e), e.dtype) for n, e in ckpt_index(ckpt).items()}
    tokens = parity.fixed_tokens(cfg.vocab_size, 20, seed=2)
    theirs = parity.hf_side(hf, tokens, 0)["logits"]
    ours = scratch.logits(scratch.parameters(weights, cfg), ms.Tensor(np.array([tokens], np.int32)), cfg,
                          pad_token_id=-1).asnumpy()[0]
    assert np.abs(ours - theirs).max() <= parity.TOLERANCE
