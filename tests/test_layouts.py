"""Every parallel layout, trained by hand on msrun CPU workers, equals the single-card run: losses and final
weights within the float32 rounding measured in the same launch (labkit.course.parallel_lab), and each worker holds
the share of the model, gradients and optimizer states its layout gives it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from labkit.byhand import runs
from labkit.byhand.comm import DIMENSIONS, Op
from labkit.byhand.pipeline_parallel import programs
from labkit.byhand.worker import Held
from labkit.course import parallel_lab
from labkit.errors import LabkitError
from labkit.layout import Layout
from labkit.model import scratch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result():
    return parallel_lab.compare(parallel_lab.parallel_runs("auto"))


def test_the_tolerance_is_float32_rounding_and_finer_than_one_update(result):
    tol = result["tolerance"]
    assert 0 < tol["float32_vs_float64_loss"] and 0 < tol["float32_vs_float64_weight"]
    # an AdamW update moves a weight by about lr * warmup share at the first step: a layout that lost or doubled
    # one update of one weight is outside the tolerance
    first_lr = 3e-3 / 2
    assert tol["weight"] < first_lr / 4


@pytest.mark.parametrize("name", [lay.name for n in sorted(runs.LAYOUTS) for lay in runs.LAYOUTS[n]])
def test_layout_equals_single_card(result, name):
    row, tol = result["layouts"][name], result["tolerance"]
    assert len(row.per_worker) == row.workers, "a result from every worker"
    assert row.same_names
    assert row.loss_diff <= tol["loss"], (row.loss_diff, tol)
    assert row.weight_diff <= tol["weight"], (row.weight_diff, tol)


def _bytes(names) -> int:
    shapes = scratch.shapes(runs.model_cfg())
    return 4 * sum(int(np.prod(shapes[n])) for n in names)


def test_each_worker_holds_its_share(result):
    cfg = runs.model_cfg()
    every = _bytes(scratch.shapes(cfg))
    # tensor parallel splits every layer's matrices and, vocabulary-parallel, the embedding and the head
    split = _bytes(n for n in scratch.shapes(cfg) if scratch.Shard(tp_size=2, vocab_parallel=True).splits(n))
    assert split > _bytes(n for n in scratch.shapes(cfg) if n.endswith(scratch.ROW_SPLIT + scratch.COL_SPLIT))
    lay = result["layouts"]
    for w in lay["dp2"].per_worker:
        assert w.held == Held(params=every, grads=every, optimizer=2 * every)
    for name in ("tp2", "sp2", "dp2_tp2", "tp2_cp2_ulysses"):
        for w in lay[name].per_worker:
            assert w.held.params == every - split // 2  # the split matrices halved, the rest replicated
    for name in ("cp2_ring", "cp2_ulysses", "dp2_cp2_ring"):  # context parallel replicates every weight
        for w in lay[name].per_worker:
            assert w.held == Held(params=every, grads=every, optimizer=2 * every)
    padded = -(-every // 8) * 8  # ZeRO's flat buffer: 4-byte elements, padded to a multiple of 2 workers
    for w in lay["zero1"].per_worker:
        assert w.held == Held(params=every, grads=every, optimizer=padded)  # m and v: half each
    for w in lay["zero2"].per_worker:
        assert w.held == Held(params=every, grads=padded // 2, optimizer=padded)
    # optimizer parallel: the embedding, each layer, the final norm with the head, each padded to a multiple of 2
    # elements; a worker keeps half of each (weights, m, v), and gathers all units (level1/2) or one at a time
    # (level3: the largest unit at its peak)
    names = list(scratch.shapes(cfg))
    units = [[scratch.EMBED]] + [[n for n in names if n.startswith(scratch.LAYER.format(i))]
                                 for i in range(cfg.num_layers)] + [[scratch.NORM, scratch.HEAD]]
    assert sorted(n for u in units for n in u) == sorted(names)
    unit_bytes = [-(-_bytes(u) // 8) * 8 for u in units]
    slices, largest = sum(unit_bytes) // 2, max(unit_bytes)
    assert slices * 2 == padded and largest < padded / 3  # no padding in the tiny model; 4 units
    for name, grads, gathered in (("opt1", 2 * slices, 2 * slices), ("opt2", slices, 2 * slices),
                                  ("opt3", slices, largest)):
        for w in lay[name].per_worker:
            assert w.held == Held(params=slices, grads=grads, optimizer=2 * slices, gathered=gathered)
    stages = [w.held.params for w in lay["pp2_1f1b"].per_worker]
    assert sum(stages) == every
    tp_pp = {(w.place.pp, w.place.tp): w.held.params for w in lay["sp2_pp2"].per_worker}
    assert sum(v for (_, tp), v in tp_pp.items() if tp == 0) == every - split // 2  # both stages of one tp rank
    for w in lay["dp2_tp2_pp2"].per_worker:  # each data-parallel replica holds what the tp2 x pp2 workers hold
        assert w.held.params == tp_pp[(w.place.pp, w.place.tp)]


def _stage0_idle_floor(stage0: list, stage1: list) -> float:
    """The least idle share stage 0 can have had in a step, from causality alone (two stages; `stageN`: its timeline,
    (action, micro-batch, start, end) rows): stage 1 starts its first forward only after stage 0's first forward has
    sent its activations, and stage 0 starts its last backward only after stage 1's last backward has sent its
    gradient; in between stage 1 runs all its forwards and backwards one after the other. So stage 0's step lasts
    at least its first forward + all of stage 1's compute + its last backward, whatever the load (durations on
    either worker are CLOCK_MONOTONIC differences), and idle = 1 - its own compute / that."""
    compute = lambda timeline: sum(t1 - t0 for a, _, t0, t1 in timeline if a in ("F", "B"))  # noqa: E731
    first, last = stage0[0], stage0[-1]
    assert first[0] == "F" and last[0] == "B"
    return 1 - compute(stage0) / ((first[3] - first[2]) + compute(stage1) + (last[3] - last[2]))


def test_pipeline_runs_the_schedule_it_names(result):
    """In every pipeline layout (alone or composed with dp and tp), every step of each stage ran its program
    (labkit.byhand.pipeline_parallel.programs) in order, one action after the other, and held the micro-batches the
    schedule says at its peak (GPipe m, 1F1B p - stage). The idle share is a timing, so no bound is asserted from
    one machine's run; stage 0's is checked against the floor its dependencies on stage 1 force
    (`_stage0_idle_floor`), which holds under any load. GPipe and 1F1B have the same floor: the same work in another
    order (the difference between them is what each stage holds, checked here too)."""
    piped = [row for row in result["layouts"].values() if row.layout.pp > 1]
    assert {row.layout.name for row in piped} >= {"pp2_gpipe", "pp2_1f1b", "dp2_pp2", "sp2_pp2", "dp2_tp2_pp2"}
    for row in piped:
        lay = row.layout
        chains = {}  # the workers of one pipeline: same data- and tensor-parallel index, by stage
        for w in row.per_worker:
            chains.setdefault((w.place.dp, w.place.tp), {})[w.place.pp] = w.pipeline
        assert len(chains) == lay.dp * lay.tp
        for stages in chains.values():
            assert sorted(stages) == list(range(lay.pp))
            for stage, steps in stages.items():
                assert len(steps) == runs.SETTINGS["steps"], "one pipeline record per training step"
                peak = lay.micro if lay.schedule == "gpipe" else min(lay.micro, lay.pp - stage)
                program = [list(a) for a in programs(lay.schedule, lay.micro, lay.pp)[stage]]
                for step in steps:
                    assert step.peak_held_microbatches == peak, (lay.name, stage)
                    assert [[a, j] for a, j, _, _ in step.timeline] == program
                    ends = [t for _, _, t0, t1 in step.timeline for t in (t0, t1)]
                    assert ends == sorted(ends), "actions one after the other"
            if lay.pp == 2:
                for s0, s1 in zip(stages[0], stages[1], strict=True):
                    floor = _stage0_idle_floor(s0.timeline, s1.timeline)
                    assert s0.idle_share >= floor - 1e-9, (lay.name, s0.idle_share, floor)


def test_each_worker_holds_what_the_planner_says_or_a_named_cause(result):
    """The planner's per-card weights, gradients and optimizer states against what each worker held; every
    difference is a term `parallel_lab.explained` names (the embedding split by vocabulary under TP, which the
    planner keeps whole as mindformers' default does; ZeRO-2's gradient shard; the embedding and norms MindSpore's
    optimizer parallel leaves whole, which the lab's opt1-3 shard)."""
    rows = parallel_lab.against_planner(result)
    terms = lambda r: 4 if r.layout.opt_level else 3  # noqa: E731  optimizer parallel: + the gathered weights
    assert len(rows) == sum(terms(r) * len(r.per_worker) for r in result["layouts"].values())
    assert all(r["unexplained"] == 0 for r in rows), [r for r in rows if r["unexplained"]]
    assert any(r["explained"] for r in rows)


def test_bytes_sent_are_the_textbook_volumes(result):
    """At the collectives, the bytes of the tensors really passed, per step, against the formulas from the
    configuration; the process's own read/write counter carries at least that many."""
    rows = parallel_lab.comm_rows(result)
    assert {r["dimension"] for r in rows} == {"dp", "tp", "sp", "pp", "zero", "opt", "vocab", "cp"}
    for r in rows:
        assert r["counted"] == pytest.approx(r["textbook"], rel=1e-9), r
        assert r["cpu_stand_in"] >= r["counted"]  # a reduce-scatter sent as an all-reduce: more, never less
        assert r["io_per_step"] >= r["counted"], r


def test_every_name_a_run_recorded_belongs_to_one_dimension(result):
    """The comparison groups traffic by `comm.DIMENSIONS` (tests/test_comm.py: each Op in exactly one):
    every worker recorded only Ops, and every dimension the textbook counts was recorded by some run."""
    recorded = {op for row in result["layouts"].values() for w in row.per_worker for op in w.traffic}
    assert all(isinstance(op, Op) for op in recorded)
    for op in recorded:
        assert sum(op in dim.textbook + dim.beside for dim in DIMENSIONS.values()) == 1, op
    assert all(set(ops) & recorded for ops in parallel_lab.MAIN_OPS.values())


def test_a_result_file_from_other_code_is_refused(result, tmp_path):
    """A rank file with a key this code does not write (or without one it does) is an error naming the file,
    not a layout rebuilt from defaults; an unknown traffic name too."""
    written = result["layouts"]["tp2"].per_worker[0].to_json()
    for change in (lambda d: d["layout"].pop("vocab"), lambda d: d.update(place=[0, 0, 0]),
                   lambda d: d["traffic"].update(tp_mystery={"calls": 1, "sent_bytes": 1.0, "ideal_bytes": 1.0})):
        d = json.loads(written)
        change(d)
        path = tmp_path / "rank0.json"
        path.write_text(json.dumps(d))
        with pytest.raises(LabkitError, match="rank0.json"):
            runs.RankResult.from_json(path)
    path.write_text(written)
    assert runs.RankResult.from_json(path) == result["layouts"]["tp2"].per_worker[0]


def test_a_strategy_points_at_the_runs_that_showed_its_dimensions(result, tmp_path):
    every = Layout(dp=2, mp=2, pp=2, optimizer_shard=True, sequence_parallel=True, cp=4, cp_algo="hybrid_cp",
                   ulysses_degree=2)
    rows = parallel_lab.evidence(every)
    assert len(rows) == 9 and all(r["used"] and r["equal to one card"] is True for r in rows)
    assert {r["shown by"].split()[0] for r in rows} <= {lay.name for n in runs.LAYOUTS for lay in runs.LAYOUTS[n]}
    plain = parallel_lab.evidence(Layout(dp=8), root=tmp_path)
    assert [r["used"] for r in plain] == [True] + [False] * 8
    assert all("run notebook 06a" in r["equal to one card"] for r in plain)  # nothing cached there: says what to run


def test_context_parallel_passes_what_its_algorithm_says(result):
    """Per layer and step, ring attention passes its key/value block cp - 1 times forward and its gradient as many
    times back (a point-to-point send each, counted; its CPU stand-in an all-reduce, 2(cp - 1) times the block);
    Ulysses runs 4 all-to-alls forward and 4 backward. Every cp worker of one replica holds the same weights, and
    every worker of a layout reports the same losses."""
    cfg, steps = runs.model_cfg(), runs.SETTINGS["steps"]
    for name in ("cp2_ring", "cp2_ulysses", "dp2_cp2_ring", "tp2_cp2_ulysses"):
        row = result["layouts"][name]
        lay = row.layout
        ring = lay.cp_algo == "ring"
        fwd, bwd = (Op.CP_RING_FWD, Op.CP_RING_BWD) if ring else (Op.CP_ALL_TO_ALL_FWD, Op.CP_ALL_TO_ALL_BWD)
        per_layer = lay.cp - 1 if ring else 4
        for w in row.per_worker:
            for op in (fwd, bwd):
                assert w.traffic[op].calls == per_layer * cfg.num_layers * steps, (name, op)
            if ring:
                assert w.traffic[fwd].sent_bytes == 2 * (lay.cp - 1) * w.traffic[fwd].ideal_bytes
            assert w.losses == row.per_worker[0].losses
        by_tp = {}
        for w in row.per_worker:
            by_tp.setdefault((w.place.dp, w.place.tp), []).append(w.weights)
        for copies in by_tp.values():
            assert len(copies) == lay.cp
            assert all(np.array_equal(c[k], copies[0][k]) for c in copies[1:] for k in copies[0])


def test_the_ring_workers_record_their_work_per_step_and_zigzag_leaves_none_idle(result):
    """What each ring worker computed at each step, counted block by block as it ran, is the zigzag split's
    `ring_units` for the sequences, heads, layers and steps it ran: the same at every step for every worker, so no
    one waits; the contiguous split counted for the same run leaves worker r of cp (cp - 1 - r) x 4c² per sequence
    and head waiting. Times are printed, not compared (wall clock on a shared machine)."""
    from labkit.byhand import context_parallel as cpl
    from labkit.course import cp_lab

    cfg, s = runs.model_cfg(), runs.SETTINGS
    rows = cp_lab.ring_idle(result)
    assert {r["layout"] for r in rows} == {"cp2_ring", "dp2_cp2_ring"} and len(rows) == 2 + 4
    for r in rows:
        lay = result["layouts"][r["layout"]].layout
        w = next(w for w in result["layouts"][r["layout"]].per_worker if w.rank == r["rank"])
        c, scale = s["seq_len"] // (2 * lay.cp), s["global_batch"] // lay.dp * cfg.num_heads * cfg.num_layers * s["steps"]
        assert [t.units for t in w.ring] == [scale * step[w.place.cp] for step in cpl.ring_units(lay.cp, c)]
        assert all(t.seconds > 0 for t in w.ring)
        assert r["zigzag idle units"] == 0
        assert r["naive idle units"] == scale * (lay.cp - 1 - w.place.cp) * 4 * c * c
        assert r["units"] == scale * sum(cpl.ring_units(lay.cp, c)[t][w.place.cp] for t in range(lay.cp))
        print(f"{r['layout']} rank {r['rank']}: {r['units']} units, idle zigzag {r['zigzag idle units']} "
              f"naive {r['naive idle units']} (~{r['naive idle ms']:.1f} ms at {r['ns per unit']:.2f} ns/unit)")
    for name in ("cp2_ulysses", "tp2_cp2_ulysses", "dp2"):
        assert all(w.ring == () for w in result["layouts"][name].per_worker)
