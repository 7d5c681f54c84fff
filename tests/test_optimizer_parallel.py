"""One process, no msrun: the sharded optimizer steps equal a plain AdamW step of the whole model on the same batch.
MindSpore's optimizer parallel at levels 1-3 (labkit.byhand.optimizer_parallel) and the lab's ZeRO-1/2
(labkit.byhand.data_parallel) run on dp = 3 workers that are threads of this process (tests/thread_group.py), two
micro-batches each, for two steps (the second reads the slices the first kept); a model whose flat buffers are not
multiples of 3 makes the padding real. Each worker holds the bytes its level says, gathered weights included. The
msrun runs (tests/test_layouts.py) train the same code between processes."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from labkit.byhand.comm import Group
from labkit.byhand.optimizer_parallel import OptimizerParallel, units
from labkit.byhand.runs import TRAIN
from labkit.byhand.worker import HandLayout, Held, Worker
from labkit.config import model_preset
from labkit.errors import LabkitError
from labkit.model import scratch

sys.path.insert(0, str(Path(__file__).parent))
from thread_group import Threads  # noqa: E402

DP, MICRO, STEPS = 3, 2, 2
CFG = model_preset("tiny", vocab_size=100, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=40)


def _batches() -> list:
    """Per step, the global batch of DP x MICRO rows of token ids [1, s+1], some of them padding."""
    rng = np.random.default_rng(7)
    ids = rng.integers(1, CFG.vocab_size, (STEPS, DP * MICRO, 13)).astype(np.int32)
    ids[:, 1, -4:] = CFG.pad_token_id
    return list(ids)


def _alone() -> dict:
    return {k: Group("none", 1, 0) for k in ("tp", "pp")}


@pytest.fixture(scope="module")
def single(ms):
    full = scratch.init(CFG, 3)
    w = Worker(CFG, HandLayout("single"), full, 0, {"dp": Group("none", 1, 0), **_alone()}, TRAIN)
    rows = [w.train_step([b]) for b in _batches()]
    return full, rows, w.weights()


def _padded(names) -> int:
    shapes = scratch.shapes(CFG)
    return -(-sum(int(np.prod(shapes[n])) for n in names) // DP) * DP


@pytest.mark.parametrize("name, kind, fields", [
    ("zero1", Worker, {"zero": 1}), ("zero2", Worker, {"zero": 2}),
    ("opt1", OptimizerParallel, {"opt_level": 1}), ("opt2", OptimizerParallel, {"opt_level": 2}),
    ("opt3", OptimizerParallel, {"opt_level": 3})])
def test_a_sharded_step_is_one_cards_adamw_step(single, name, kind, fields):
    full, want, want_weights = single
    layout = HandLayout(name, dp=DP, micro=MICRO, **fields)
    layout.check(CFG, DP * MICRO)

    def worker(member):
        w = kind(CFG, layout, full, member.index, {"dp": member, **_alone()}, TRAIN)
        r = member.index
        rows = [w.train_step([b[MICRO * r + j:MICRO * r + j + 1] for j in range(MICRO)]) for b in _batches()]
        return rows, w.weights(), w.bytes_held()

    for rows, weights, _ in Threads(DP).run(worker):
        for got, ref in zip(rows, want, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert sorted(weights) == sorted(want_weights)
        for n, ref in want_weights.items():
            assert np.abs(ref - full[n]).max() > 1e-4  # the steps moved every weight
            # AdamW divides by sqrt(v): on an element with a near-zero gradient another summation order moves the
            # update by ~1e-7..1e-6; one AdamW update is ~lr = 1.5e-3 on every element, 300 times the tolerance
            np.testing.assert_allclose(weights[n], ref, rtol=1e-5, atol=5e-6, err_msg=n)


def test_each_level_holds_its_slices_and_gathers_what_it_says(ms):
    """Bytes per worker from the shapes alone: every unit padded to a multiple of 3, a third of it kept; level1's
    accumulation buffer full, level2/3's a slice; gathered: every unit at level1/2, the largest unit at level3
    (one unit is gathered at a time, forward and backward)."""
    full = scratch.init(CFG, 3)
    per_unit = [_padded(u) for u in units(CFG)]
    every, largest = 4 * sum(per_unit), 4 * max(per_unit)
    assert len(set(per_unit)) > 1 and every != 4 * sum(int(np.prod(s)) for s in scratch.shapes(CFG).values())
    want = {1: {"grads": every, "gathered": every}, 2: {"grads": every // DP, "gathered": every},
            3: {"grads": every // DP, "gathered": largest}}
    for level, expected in want.items():
        layout = HandLayout(f"opt{level}", dp=DP, opt_level=level, micro=MICRO)

        def worker(member):
            w = OptimizerParallel(CFG, layout, full, member.index, {"dp": member, **_alone()}, TRAIN)
            b, r = _batches()[0], member.index
            w.train_step([b[MICRO * r + j:MICRO * r + j + 1] for j in range(MICRO)])
            return w.bytes_held()

        for held in Threads(DP).run(worker):
            assert held == Held(params=every // DP, optimizer=2 * every // DP, **expected), level


@pytest.mark.parametrize("fields, says", [
    ({"dp": 2, "zero": 1, "opt_level": 1}, "two ways of sharding"),
    ({"dp": 1, "tp": 2, "opt_level": 2}, "optimizer parallel is written here for pure data parallel"),
    ({"dp": 2, "opt_level": 4}, "opt_level 0 to 3")])
def test_a_layout_refuses_what_optimizer_parallel_does_not_do(fields, says):
    with pytest.raises(LabkitError, match=says):
        HandLayout("x", **fields).check(CFG, 8)


def test_the_layouts_train_as_the_tiny_config_says():
    """The hand-written layouts take TrainConfig's defaults with a shortened schedule (runs.TRAIN): the defaults
    must stay the optimizer configs/tiny_cpu.yaml trains the one-card runs with."""
    from labkit.config import load_run_config

    tiny = load_run_config("configs/tiny_cpu.yaml").train
    for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
        assert getattr(TRAIN, name) == getattr(tiny, name), name
