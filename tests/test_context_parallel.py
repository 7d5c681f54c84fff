"""Context parallelism by hand (labkit.byhand.context_parallel), in one process: attention over a sequence cut
into blocks and merged by the online softmax equals full causal grouped-query attention with padding, for the
contiguous and the balanced split; the balanced split gives every worker the same work and the contiguous one
does not; Ulysses' all-to-all round trip is exact and refuses head counts it cannot split; and ring attention and
Ulysses with workers as threads (tests/thread_group.py, forward only: PyNative autodiff does not interleave
between threads) give each worker its part of one card's attention output. Trained between msrun processes, the
cp layouts equal one card in tests/test_layouts.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from labkit.byhand import context_parallel as cpl
from labkit.byhand.comm import Group
from labkit.byhand.worker import HandLayout
from labkit.config import model_preset
from labkit.errors import LabkitError
from labkit.model import scratch

sys.path.insert(0, str(Path(__file__).parent))
from thread_group import Threads  # noqa: E402

CFG = model_preset("tiny", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=40)
B, S = 2, 16


def _qkv_mask(ms, heads: int = 4, kv: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    d = CFG.hidden_size // CFG.num_heads
    q, k, v = (ms.Tensor(rng.normal(size=(B, n, S, d)).astype(np.float32)) for n in (heads, kv, kv))
    mask = np.ones((B, S), np.float32)
    mask[1, -5:] = 0  # padding at the end of the second row, as the loader pads
    return q, k, v, ms.Tensor(mask)


def _full(q, k, v, mask):
    return scratch.core_attention(q, k, v, scratch.mask_adder(mask)).asnumpy()


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_blocks_merged_by_online_softmax_equal_full_attention(ms, cp, balanced):
    q, k, v, mask = _qkv_mask(ms)
    got = cpl.split_attention(q, k, v, mask, cp, balanced).asnumpy()
    np.testing.assert_allclose(got, _full(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_the_default_hooks_are_the_one_card_attention(ms):
    """scratch.attention through Hooks.attend is the causal GQA softmax written out."""
    q, k, v, mask = _qkv_mask(ms)
    kk, vv = (np.repeat(t.asnumpy(), 2, axis=1) for t in (k, v))
    scores = q.asnumpy() @ kk.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + scratch.mask_adder(mask).asnumpy()
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    np.testing.assert_allclose(scratch.Hooks().attend(q, k, v, scratch.Hooks().frame(CFG, mask)).asnumpy(), want,
                               rtol=1e-5, atol=1e-6)


def test_the_balanced_split_gives_every_worker_the_same_work():
    for cp in (2, 3, 4, 8):
        assert cpl.work(cp, balanced=True) == [2 * cp + 1] * cp
        naive = cpl.work(cp, balanced=False)
        assert naive == [4 * r + 3 for r in range(cp)] and len(set(naive)) == cp
        assert sum(naive) == sum(cpl.work(cp)) == (2 * cp) * (2 * cp + 1) // 2  # the same blocks, spread otherwise
    assert cpl.chunks_of(2, 0) == (0, 3) and cpl.chunks_of(2, 1) == (1, 2)
    assert list(cpl.positions(8, 2, 1)) == [2, 3, 4, 5] and list(cpl.positions(8, 2, 0)) == [0, 1, 6, 7]
    with pytest.raises(LabkitError, match="multiple of 4"):
        cpl.positions(10, 2, 0)


def test_ulysses_round_trip_is_exact_and_bad_head_counts_are_refused(ms):
    q = _qkv_mask(ms)[0]
    parts = [cpl.take(q, 2, 2, r) for r in range(2)]

    def worker(g):
        heads = g.all_to_all(parts[g.index], 1, 2)  # sequence split -> head split
        assert heads.shape == (B, 2, S, q.shape[-1])
        return g.all_to_all(heads, 2, 1).asnumpy()  # and back

    back = Threads(2).run(worker)
    for r in range(2):
        assert np.array_equal(back[r], parts[r].asnumpy())
    with pytest.raises(LabkitError, match="num_kv_heads 2") as e:
        cpl.check_ulysses(4, 2, 4)
    assert "ring" in str(e.value.fix)
    with pytest.raises(LabkitError, match="num_kv_heads"):  # tp2 leaves one kv head per worker: not two to split
        HandLayout("tp2_cp2_ulysses", tp=2, cp=2, cp_algo="ulysses").check(CFG, 8)
    HandLayout("tp2_cp2_ring", tp=2, cp=2).check(CFG, 8)
    with pytest.raises(LabkitError, match="'stripes' is not known"):
        HandLayout("cp2", cp=2, cp_algo="stripes").check(CFG, 8)


@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_thread_workers_give_their_part_of_one_cards_attention(ms, algo, cp):
    """Each worker holds its chunks of q, k, v (RoPE at global positions is the frame's: checked below); its
    ring or Ulysses output is its chunks of the whole attention."""
    heads, kv = (4, 4) if algo == "ulysses" and cp == 4 else (4, 2)  # Ulysses over 4 needs 4 kv heads
    q, k, v, mask = _qkv_mask(ms, heads, kv, seed=cp)
    want = _full(q, k, v, mask)

    def worker(g):
        hooks = cpl.ContextParallel(g, algo)
        frame = hooks.frame(CFG, mask)
        mine = [hooks.take(t, 2) for t in (q, k, v)]
        return hooks.attend(*mine, frame).asnumpy(), frame

    done = Threads(cp).run(worker)
    cos, sin = scratch.rope_tables(CFG, S)
    for r, (got, frame) in enumerate(done):
        at = cpl.positions(S, cp, r)
        np.testing.assert_allclose(got, want[:, :, at], rtol=1e-5, atol=1e-6)
        assert np.array_equal(frame.cos.asnumpy(), cos.asnumpy()[at])
        assert np.array_equal(frame.sin.asnumpy(), sin.asnumpy()[at])


def test_a_layer_on_one_worker_of_one_is_the_one_card_layer(ms):
    """ContextParallel over a group of one is one card: the whole layer (projections, RoPE, attention) agrees."""
    full = scratch.init(CFG, 3)
    p = scratch.parameters(full, CFG)
    x = ms.Tensor(np.random.default_rng(4).normal(size=(B, S, CFG.hidden_size)).astype(np.float32))
    mask = _qkv_mask(ms)[3]
    want = scratch.layer(p, 0, x, CFG, scratch.Shard(), scratch.Hooks(), scratch.Hooks().frame(CFG, mask))
    hooks = cpl.ContextParallel(Group("none", 1, 0), "ring")
    got = scratch.layer(p, 0, x, CFG, scratch.Shard(), hooks, hooks.frame(CFG, mask))
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)


def test_cp_sits_next_to_tp_in_the_rank_order():
    """rank = ((dp * pp + pp_index) * cp + cp_index) * tp + tp_index; the gradients are summed over dp x cp."""
    lay = HandLayout("dp2_cp2_tp2", dp=2, cp=2, tp=2)
    assert lay.workers == 8
    assert [lay.place(r).cp for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert all(lay.rank_at(p.dp, p.pp, p.tp, p.cp) == r for r in range(8) for p in [lay.place(r)])
    m = lay.members(5)  # dp 1, cp 0, tp 1
    assert (m["tp"], m["cp"], m["dp"], m["dp_cp"]) == ([4, 5], [5, 7], [1, 5], [1, 3, 5, 7])
    with pytest.raises(LabkitError, match="data and tensor parallel only"):
        HandLayout("cp2_pp2", cp=2, pp=2, micro=2).check(CFG, 8)


@pytest.mark.parametrize("world", [False, True])
def test_the_cpu_stand_ins_are_a_ring_step_and_an_all_to_all_and_count_both(ms, world):
    """comm.Group's shift and all_to_all, with thread members in place of MindSpore's AllReduce and AllGather:
    worker r gets worker r-1's tensor, and every worker's r-th slice along one axis joined along the other; each
    counts its stand-in's bytes as sent and the real operation's as ideal."""
    from labkit.byhand.comm import Op, Sent

    p, shape = 3, (2, 6, 4, 3)
    xs = [np.random.default_rng(r).normal(size=shape).astype(np.float32) for r in range(p)]
    n = xs[0].nbytes

    def worker(m):
        g = Group("threads", p, m.index, tuple(range(p)), world=world)
        g._ops = {"all_reduce": m.all_reduce, "all_gather": lambda x: m.all_gather(x, 0)}
        x = ms.Tensor(xs[m.index])
        return g.shift(x, 1, Op.CP_RING_FWD).asnumpy(), g.all_to_all(x, 1, 2, Op.CP_ALL_TO_ALL_FWD).asnumpy(), \
            g.traffic.counts()

    for r, (passed, exchanged, counts) in enumerate(Threads(p).run(worker)):
        assert np.array_equal(passed, xs[(r - 1) % p])
        assert np.array_equal(exchanged, np.concatenate([x[:, 2 * r:2 * r + 2] for x in xs], axis=2))
        assert counts[Op.CP_RING_FWD] == Sent(1, 2 * (p - 1) * n, n)
        assert counts[Op.CP_ALL_TO_ALL_FWD] == Sent(1, (1 if world else 2) * (p - 1) * n, (p - 1) / p * n)


def test_the_ring_step_by_step_zigzag_keeps_every_worker_busy_the_naive_split_does_not():
    """Per ring step the score elements each worker computes (the causal mask's unmasked ones), worked out by hand:
    at step 0 every worker has its own two chunks (two diagonal blocks and one full: c(c+1) + c²); after that
    zigzag gives everyone two full blocks (2c²), the contiguous split 4c² to a worker whose block arrives from an
    earlier worker and 0 to the others. Worker r of the naive split waits (cp - 1 - r) x 4c²; zigzag's wait 0."""
    c = 4
    for cp in (2, 3, 4, 8):
        first = c * (c + 1) + c * c
        zig, naive = cpl.ring_units(cp, c, True), cpl.ring_units(cp, c, False)
        assert zig == [[first] * cp] + [[2 * c * c] * cp] * (cp - 1)
        assert naive[0] == [first] * cp
        assert naive[1:] == [[4 * c * c if (r - t) % cp < r else 0 for r in range(cp)] for t in range(1, cp)]
        assert cpl.idle_units(zig) == [0] * cp
        assert cpl.idle_units(naive) == [(cp - 1 - r) * 4 * c * c for r in range(cp)]
        for balanced, steps in ((True, zig), (False, naive)):  # the same pairs as `work`, now per step
            assert sum(map(sum, steps)) == sum(cpl.work(cp, balanced)) * c * c - 2 * cp * c * (c - 1) // 2


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_ring_worker_records_the_work_it_computed_at_each_step(ms, cp, balanced):
    """Thread workers run ring attention forward with either split: what each records per step, counted block by
    block as it merged them, is `ring_units` for every sequence and head (and the output its part of one card's)."""
    q, k, v, mask = _qkv_mask(ms, seed=cp)
    want = _full(q, k, v, mask)

    def worker(g):
        hooks = cpl.ContextParallel(g, "ring", balanced=balanced)
        out = hooks.attend(*[hooks.take(t, 2) for t in (q, k, v)], hooks.frame(CFG, mask))
        return out.asnumpy(), hooks.ring_steps()

    units = cpl.ring_units(cp, S // (2 * cp), balanced)
    done = Threads(cp).run(worker)
    for r, (got, steps) in enumerate(done):
        at = cpl.positions(S, cp, r, balanced)
        np.testing.assert_allclose(got, want[:, :, at], rtol=1e-5, atol=1e-6)
        assert [s.units for s in steps] == [B * q.shape[1] * units[t][r] for t in range(cp)]
        assert all(s.seconds > 0 for s in steps if s.units)
    idle = cpl.idle_units([[done[r][1][t].units for r in range(cp)] for t in range(cp)])
    assert (max(idle) == 0) == balanced
