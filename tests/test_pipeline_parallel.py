"""The hand-written pipeline (labkit.byhand.pipeline_parallel): its programs pair every transfer between the two
stages of a boundary, run each micro-batch forward then backward once per stage and hold what the schedule says;
and, in one process with workers as threads (tests/thread_group.py), pipelines of 3 and 4 stages and one composed
with data parallelism train two steps equal to one card. Tensor parallelism's collectives run inside the autodiff of
a forward, which MindSpore's PyNative executor cannot interleave between threads: the pipelines composed with it
(sp2_pp2, dp2_tp2_pp2) train between msrun processes (tests/test_layouts.py), as every layout does there too."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from labkit.byhand.comm import Group
from labkit.byhand.pipeline_parallel import orders, pipeline_step, programs, simulate, transfers
from labkit.byhand.runs import TRAIN
from labkit.byhand.worker import HandLayout, Worker
from labkit.config import model_preset
from labkit.errors import LabkitError
from labkit.model import scratch

sys.path.insert(0, str(Path(__file__).parent))
from thread_group import World  # noqa: E402


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (2, 4), (2, 7), (3, 2), (3, 5), (4, 4), (4, 8), (5, 3)])
def test_pipeline_programs_pair_their_transfers(schedule, p, m):
    """Transfers pair up only if the two stages of a boundary take part in them in the same order; every
    micro-batch is computed forward then backward once on each stage, in the simulated order; the stashed
    micro-batches peak at m (GPipe) or p - stage (1F1B)."""
    prog = programs(schedule, m, p)
    for i in range(p - 1):
        assert transfers(prog[i], 1) == transfers(prog[i + 1], 0), (i, prog)
        assert len(transfers(prog[i], 1)) == 2 * m  # each micro-batch's activations forward, gradient back
    for stage in range(p):
        computed = [(a, j) for a, j in prog[stage] if a in ("F", "B")]
        assert computed == orders(p, m, schedule)[stage]
        assert all(computed.index(("F", j)) < computed.index(("B", j)) for j in range(m))
        live = peak = 0
        for a, _ in computed:
            live += 1 if a == "F" else -1
            peak = max(peak, live)
        assert peak == (m if schedule == "gpipe" else min(m, p - stage))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 8)])
def test_the_programs_can_always_proceed(schedule, p, m):
    """Run the programs as blocking rendezvous: a stage waits at a transfer until its peer reaches the same one.
    Every stage finishes (no cycle of waits), whatever order the stages are stepped in."""
    for turn in (range(p), range(p - 1, -1, -1)):
        prog, pos = programs(schedule, m, p), [0] * p
        while any(pos[i] < len(prog[i]) for i in range(p)):
            moved = False
            for i in turn:
                while pos[i] < len(prog[i]):
                    a, j = prog[i][pos[i]]
                    if a in ("F", "B"):
                        pos[i] += 1
                        continue
                    peer = i + 1 if a in ("send_act", "recv_grad") else i - 1
                    want = {"send_act": "recv_act", "recv_act": "send_act", "send_grad": "recv_grad",
                            "recv_grad": "send_grad"}[a]
                    if pos[peer] < len(prog[peer]) and prog[peer][pos[peer]] == (want, j):
                        pos[i] += 1
                        pos[peer] += 1
                        moved = True
                    break
            assert moved or all(pos[i] == len(prog[i]) for i in range(p)), ("stuck", pos)


def test_unknown_schedules_and_empty_pipelines_are_refused():
    with pytest.raises(LabkitError, match="zero_bubble"):
        programs("zero_bubble", 4, 2)
    with pytest.raises(LabkitError, match="micro-batches"):
        simulate(2, 0)


# ------------------------------------------------------------------------ trained, workers as threads of one process

# 4 layers, so that 4 stages each hold one (3 stages: 2, 1, 1); small enough for 8 threads in a few seconds
CFG = model_preset("tiny", vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=40)
STEPS, ROWS, SEQ = 2, 8, 12


def _batches() -> list:
    """Per step, the global batch: ROWS rows of token ids [s+1], some of them padding."""
    rng = np.random.default_rng(11)
    ids = rng.integers(1, CFG.vocab_size, (STEPS, ROWS, SEQ + 1)).astype(np.int32)
    ids[:, 3, -5:] = CFG.pad_token_id
    return list(ids)


@pytest.fixture(scope="module")
def single(ms):
    full = scratch.init(CFG, 5)
    alone = {k: Group("none", 1, 0) for k in ("dp", "tp", "pp", "pp_prev", "pp_next")}
    w = Worker(CFG, HandLayout("single"), full, 0, alone, TRAIN)
    return full, [w.train_step([b]) for b in _batches()], w.weights()


def _rows(layout: HandLayout, place, batch) -> list:
    """The micro-batches of one data-parallel index, as the loader splits the global batch (dp, then micro)."""
    per = ROWS // layout.dp
    mine = batch[place.dp * per:(place.dp + 1) * per]
    b = per // layout.micro
    return [mine[k * b:(k + 1) * b] for k in range(layout.micro)]


@pytest.mark.parametrize("layout", [
    HandLayout("pp4_1f1b", pp=4, micro=4), HandLayout("pp3_gpipe", pp=3, micro=4, schedule="gpipe"),
    HandLayout("dp2_pp4", dp=2, pp=4, micro=2)], ids=lambda lay: lay.name)
def test_a_pipeline_of_any_shape_trains_as_one_card(single, layout):
    full, want, want_weights = single
    layout.check(CFG, ROWS)
    world = World(layout.workers)

    def worker(rank):
        groups = {k: world.group(v, rank) for k, v in layout.members(rank).items()}
        w = Worker(CFG, layout, full, rank, groups, TRAIN)
        rows = [pipeline_step(w, _rows(layout, w.place, b)) for b in _batches()]
        return w, rows

    done = world.run(worker)
    for w, rows in done:
        for got, ref in zip(rows, want, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            held = 1 + sum(1 for a, _, _, _ in got["stage"].timeline if a == "F") - \
                sum(1 for a, _, _, _ in got["stage"].timeline if a == "B")
            assert held == 1  # every micro-batch it took in was given back
    # the full model from the first data-parallel replica: stages side by side, tensor-parallel slices joined
    replica = [w for w, _ in done if w.place.dp == 0]
    assert sorted(n for w in replica if w.place.tp == 0 for n in w.params) == sorted(want_weights)
    for n, ref in want_weights.items():
        parts = [w.weights()[n] for w in sorted(replica, key=lambda w: w.place.tp) if n in w.params]
        got = scratch.unshard(n, parts, layout.vocab) if layout.tp > 1 else parts[0]
        assert np.abs(ref - full[n]).max() > 1e-4  # the steps moved every weight
        # as in test_optimizer_parallel: AdamW's sqrt(v) turns summation-order noise into ~1e-6 on near-zero
        # gradients, 300 times below one update (lr 1.5e-3)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=5e-6, err_msg=n)


def test_a_stage_needs_a_layer():
    with pytest.raises(LabkitError, match="5 stages for 4 layers"):
        HandLayout("pp5", pp=5, micro=5).check(CFG, 10)
