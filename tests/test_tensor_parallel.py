"""The vocabulary-parallel embedding and cross-entropy (labkit.byhand.tensor_parallel, labkit.model.scratch) in one
process: t workers are t threads whose collectives meet at a barrier (one thread computes at a time: MindSpore's
eager executor is not safe for concurrent callers), each holding its vocabulary slice; their loss
and logit gradients must be the plain cross-entropy's on the whole vocabulary, their summed lookups the whole
table's. The msrun runs (tests/test_layouts.py) train the same code between processes."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from labkit.byhand import comm, tensor_parallel
from labkit.config import model_preset
from labkit.errors import LabkitError
from labkit.model import scratch

sys.path.insert(0, str(Path(__file__).parent))
from thread_group import Threads  # noqa: E402


def _plain(ms, logits, labels):
    from mindspore import ops

    x = ms.Tensor(logits)
    loss = lambda z: ops.cross_entropy(z, ms.Tensor(labels), reduction="none")  # noqa: E731
    ce = loss(x).asnumpy()
    grad = ms.grad(lambda z: (loss(z) * ms.Tensor(np.arange(1, len(labels) + 1, dtype=np.float32))).sum())(x)
    return ce, grad.asnumpy()


@pytest.mark.parametrize("t", [2, 4])
def test_cross_entropy_from_slices_is_the_whole_vocabularys(ms, t):
    rng = np.random.default_rng(t)
    n, v = 12, 64
    logits = (rng.standard_normal((n, v)) * 4).astype(np.float32)
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[:t] = np.arange(t) * (v // t)  # every worker owns some label: each contributes its target logit
    dce = np.arange(1, n + 1, dtype=np.float32)  # a weight per token, as the mask and 1/count give
    want_ce, want_grad = _plain(ms, logits, labels)
    k = v // t

    def worker(g):
        mine = ms.Tensor(logits[:, g.index * k:(g.index + 1) * k])
        ce, saved = tensor_parallel.ce_forward(mine, ms.Tensor(labels), g)
        return ce.asnumpy(), tensor_parallel.ce_backward(saved, ms.Tensor(dce)).asnumpy()

    out = Threads(t).run(worker)
    for ce, _ in out:
        np.testing.assert_allclose(ce, want_ce, rtol=2e-6, atol=2e-6)  # every worker has every token's loss
    grad = np.concatenate([g for _, g in out], axis=1)  # each worker's slice of softmax - one-hot
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert all(np.any(g != 0) for _, g in out)


def test_the_differentiable_loss_on_one_card_is_the_plain_one(ms):
    """Through value_and_grad: `vocab_parallel_cross_entropy` wires ce_forward and ce_backward into autodiff."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 16)).astype(np.float32)
    labels = rng.integers(0, 16, 6).astype(np.int32)
    want_ce, want_grad = _plain(ms, logits, labels)
    f = tensor_parallel.vocab_parallel_cross_entropy(comm.Group("none", 1, 0))
    weight = ms.Tensor(np.arange(1, 7, dtype=np.float32))
    got = ms.grad(lambda z: (f(z, ms.Tensor(labels)) * weight).sum())(ms.Tensor(logits))
    np.testing.assert_allclose(f(ms.Tensor(logits), ms.Tensor(labels)).asnumpy(), want_ce, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(got.asnumpy(), want_grad, rtol=1e-5, atol=1e-6)


def test_embedding_from_row_slices_is_the_whole_tables(ms):
    cfg = model_preset("tiny")
    full = scratch.init(cfg, 0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    want = full[scratch.EMBED][tokens]

    class Sum(scratch.Hooks):
        def __init__(self, g):
            self.g = g

        def embed_sum(self, e):
            return self.g.all_reduce(e)

    def worker(g):
        shard = scratch.Shard(tp_size=2, tp_rank=g.index, vocab_parallel=True)
        table = scratch.shard_array(scratch.EMBED, full[scratch.EMBED], shard)
        assert table.shape[0] == cfg.vocab_size // 2
        return scratch.embed({scratch.EMBED: ms.Tensor(table)}, ms.Tensor(tokens), Sum(g), shard).asnumpy()

    for got in Threads(2).run(worker):
        np.testing.assert_array_equal(got, want)  # one worker's row plus the other's zeros: exact


@pytest.mark.parametrize("tied", [False, True])
def test_vocabulary_slices_join_back(tied):
    cfg = model_preset("tiny", tie_word_embeddings=tied)
    full = scratch.init(cfg, 0)
    shards = [scratch.Shard(tp_size=2, tp_rank=r, vocab_parallel=True) for r in range(2)]
    for name in (scratch.EMBED,) + (() if tied else (scratch.HEAD,)):
        parts = [scratch.shard_array(name, full[name], s) for s in shards]
        assert parts[0].shape == (cfg.vocab_size // 2, cfg.hidden_size) and shards[0].splits(name)
        assert np.array_equal(scratch.unshard(name, parts, vocab_parallel=True), full[name])
    assert not scratch.Shard(tp_size=2).splits(scratch.EMBED)
    with pytest.raises(LabkitError, match="does not divide vocab_size"):
        scratch.check_shard(model_preset("tiny", vocab_size=4099), shards[0])


def test_the_head_and_loss_count_follows_the_vocabulary_split():
    """The probe's count of the head's and loss's tensors per worker: the vocabulary-sized copies (the planner's
    LOSS_FP32_COPIES float32 logits) halve on a tp2 worker whose head is vocabulary-parallel; the final norm's do
    not; with the head whole every worker counts them all."""
    from labkit.byhand import runs
    from labkit.course import parallel_lab
    from labkit.parallel.memory import LOSS_FP32_COPIES

    s = runs.MEMORY_SETTINGS
    logits = s["global_batch"] * s["seq_len"] * runs.model_cfg(s).vocab_size * 4
    by = {lay.name: parallel_lab.head_loss_count(lay) for lay in runs.MEMORY_LAYOUTS}
    assert by["single"] - by["tp2"] == LOSS_FP32_COPIES * logits / 2
    assert by["sp2"] == by["tp2"] and by["tp2_whole_vocab"] == by["single"]
    assert by["single"] / 2**20 == 136  # 4 logits copies of 32 MiB + the final norm's 8 MiB, at seq 256, batch 8
