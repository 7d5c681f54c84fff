"""What only the notebooks need of the hand-written parallel layouts (labkit.byhand): their runs (labkit.byhand.runs),
launched once per worker count and cached, shared by the notebooks and the tests, and their comparison with the
single-card reference, the planner and the textbook.

    root = parallel_runs()            # cached under runs/parallel_lab while the code that made them is unchanged
    table = compare(root)             # per layout: loss and weight differences against their tolerance

The tolerance comes from float32 rounding, measured in the same launch: the reference runs in float32 and in
float64. A float32 run's rounding moves it from the exact result by about d = |float32 - float64| (the float64
run's own error is ~1e-9 smaller). A parallel float32 run sums in another order: its distance to the exact result
is of the same kind and size, so its distance to the float32 reference is at most ~2d; the tolerance is 4d (a
factor 2 for the maximum over elements of a second, independent rounding pattern), plus, for a loss, 2 float32
ulps (the loss is summed over workers in float32)."""
from __future__ import annotations

import fcntl
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from labkit.byhand import runs
from labkit.byhand.comm import DIMENSIONS
from labkit.byhand.runs import RankResult
from labkit.byhand.worker import HandLayout, Place, stage_shard
from labkit.data.dataset import ensure_dataset
from labkit.errors import LabkitError
from labkit.launch import workers as launch_workers
from labkit.layout import Layout, OptimizerParallel
from labkit.model import scratch
from labkit.parallel.memory import Numerics, layer_activations, loss_activations, model_states, stage_at
from labkit.paths import RUNS
from labkit.sources import source_key, stamp, stamped
from labkit.training.metrics import POOL_STATS_ENV, pool_peak_mb

CACHE = RUNS / "parallel_lab"
CPU = Numerics(amp_level="O0", flash_attention=False, fused_norm=False, fused_silu=False)  # how the layouts compute
MODES = ("auto", "run", "cached")
DATA = ("data/corpus", "data/tokenizer")  # what ensure_dataset tokenises for the workers by default


def launch_key(task: list[str], workers: int, env: dict | None = None) -> str:
    """The key (labkit.sources) of one launch's results: the worker module and the launcher with every labkit
    module they import, the shipped corpus and tokenizer, and the launch's own arguments and environment."""
    return source_key(runs.__name__, launch_workers.__name__, data=DATA,
                      also=[json.dumps([task, workers, env or {}], sort_keys=True)])


def parallel_runs(mode: str = "auto", root: Path = CACHE, timeout: float = 600) -> Path:
    """The folder with every layout's results: each worker count's launch, run now unless a fresh one is cached
    ("auto"), always ("run"), or never ("cached": an error when there is none)."""
    if mode not in MODES:
        raise LabkitError(f"mode '{mode}' is not known", f"use one of {', '.join(MODES)}")
    if mode != "cached":
        ensure_dataset(runs.SETTINGS["seq_len"], progress=False)  # built once here, not by every worker at once
    root.mkdir(parents=True, exist_ok=True)
    for workers in sorted(runs.LAYOUTS):
        expected = {lay.name: workers for lay in runs.LAYOUTS[workers]}
        expected.update({r.name: runs.layouts()[r.target].workers for r in runs.RESUMES.get(workers, [])})
        _launch(mode, root / f"workers{workers}", ["worker"], workers, expected,
                what=f"the {workers}-worker parallel layouts", timeout=timeout)
    return root


def _launch(mode: str, folder: Path, task: list[str], workers: int, expected: dict[str, int], *, what: str,
            timeout: float, env: dict | None = None) -> None:
    """One msrun launch of `python -m labkit.byhand.runs TASK[0] folder TASK[1:]`, unless fresh results are
    there (folder/DONE holds today's `launch_key`); done when every run of `expected` (name: workers) has a
    result from each of its workers."""
    key, done = launch_key(task, workers, env), folder / "DONE"
    if mode == "auto" and stamped(done, key) or mode == "cached":
        if not stamped(done, key):
            raise LabkitError(f"no fresh results of {what} in {folder} (none, or made from other sources)",
                              "run it with mode 'run' (about a minute per launch)")
        return
    # a notebook and a test may ask at once: one launches while the other waits, then reads its results
    with open(folder.parent / f".lock-{folder.name}", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if mode == "auto" and stamped(done, key):
            return
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        launch_workers.run_workers(
            ["python", "-m", runs.__name__, task[0], str(folder), *task[1:]], workers, folder, what=what,
            timeout=timeout, env=env,
            expect=lambda: all(len(list((folder / n).glob("rank*.json"))) == k for n, k in expected.items()))
        stamp(done, key)


def memory_runs(mode: str = "auto", root: Path = CACHE, timeout: float = 600) -> Path:
    """The activation-memory probe's launch (runs.MEMORY_LAYOUTS side by side, MindSpore's pool statistics on),
    cached like parallel_runs; returns its folder."""
    if mode not in MODES:
        raise LabkitError(f"mode '{mode}' is not known", f"use one of {', '.join(MODES)}")
    if mode != "cached":
        ensure_dataset(runs.MEMORY_SETTINGS["seq_len"], progress=False)
    folder = root / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    for lay in runs.MEMORY_LAYOUTS:
        _launch(mode, folder / lay.name, ["memory", "--only", lay.name], lay.workers, {lay.name: lay.workers},
                what=f"the activation-memory probe of {lay.name}", timeout=timeout, env=POOL_STATS_ENV)
    return folder


RETENTION_SCRIPT = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, ops
from labkit.byhand.mappings import differentiable
ms.set_context(mode=ms.PYNATIVE_MODE); ms.set_device("CPU")
kind, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Twice(nn.Cell):
    def construct(self, x):
        return x * 2.0

    def bprop(self, x, out, dout):  # reads neither x nor out
        return (dout * 2.0,)

twice = {"cell with bprop": Twice(), "differentiable": differentiable(lambda x: x * 2.0, lambda d: d * 2.0),
         "plain ops": lambda x: x * 2.0}[kind]
w = ms.Parameter(ms.Tensor(np.ones(n, np.float32)), name="w")

def loss(x):
    h = ops.tanh(x)
    for _ in range(repeats):
        h = twice(h)
    return (h * w).sum()

ms.value_and_grad(loss, None, [w])(ms.Tensor(np.ones(n, np.float32)))
"""


def backward_retention(mib: int = 16, repeats: int = 3) -> dict:
    """The memory pool's peak (MiB) of one forward and backward pass through `repeats` doublings of a `mib` MiB
    tensor, each written as a Cell with a custom `bprop`, as `mappings.differentiable`, and as plain operators:
    what each way keeps for the backward. One process per way (the pool's peak is printed when a process ends)."""
    import os
    import subprocess
    import sys

    out = {"tensor_mib": mib, "repeats": repeats}
    for kind in ("plain ops", "differentiable", "cell with bprop"):
        p = subprocess.run([sys.executable, "-c", RETENTION_SCRIPT, kind, str(mib * 2**20 // 4), str(repeats)],
                           capture_output=True, text=True, timeout=300, env={**os.environ, **POOL_STATS_ENV})
        peak = pool_peak_mb(p.stdout + p.stderr)
        if p.returncode or peak is None:
            raise LabkitError(f"the retention probe ({kind}) failed (exit {p.returncode})", p.stderr[-2000:])
        out[kind] = peak
    return out


def head_loss_count(lay, settings: dict = runs.MEMORY_SETTINGS) -> float:
    """The planner's bytes (float32, unfused norm as on CPU) of the final norm's, the logits' and the loss's tensors
    on one worker of `lay` (a HandLayout): the logits and the loss's copies of them split over tp when the head
    is vocabulary-parallel, whole on every worker when it is not; a context-parallel worker's of its s/cp tokens."""
    mp = lay.tp if lay.tp > 1 and lay.vocab else 1
    return loss_activations(runs.model_cfg(settings), settings["seq_len"] // lay.cp, settings["global_batch"], mp=mp,
                            act_bytes=4, fused_norm=False)


def activation_memory(folder: Path | None = None) -> dict:
    """Per layout of the probe: each worker's measured memory-pool peak (MiB, from its log), what it keeps between
    steps (parameters, gradients, optimizer states), and the planner's count (float32) of the activations a worker
    stores for the backward pass and of the head's and loss's tensors (`head_loss_count`), at the probe's sequence
    and batch."""
    folder = folder or memory_runs("cached")
    s = runs.MEMORY_SETTINGS
    cfg = runs.model_cfg(s)
    out = {"seq_len": s["seq_len"], "micro_batch": s["global_batch"], "layouts": {}}
    for lay in runs.MEMORY_LAYOUTS:
        launch = folder / lay.name
        rows = _ranks(launch / lay.name)
        peaks = [pool_peak_mb((launch / "logs" / f"worker_{r.rank}.log").read_text(errors="replace")) for r in rows]
        # context parallel: the planner's count without flash attention at the s/cp tokens a worker holds (an
        # estimate: the ring's score blocks are 2cp+1 of (s/2cp)^2 where s/cp squared counts 4 of them, and Ulysses
        # holds s x s scores of heads/cp). The planner's own cp terms (labkit.parallel.cp_terms) assume flash
        # attention, which mindformers requires for cp and these CPU workers do not have
        stored = 4 * cfg.num_layers * layer_activations(cfg, s["seq_len"] // lay.cp, s["global_batch"], mp=lay.tp,
                                                        sequence_parallel=lay.sp, numerics=CPU)["stored"]
        loss = head_loss_count(lay, s)
        out["layouts"][lay.name] = {"workers": len(rows), "pool_peak_mib": peaks, "held": [r.held for r in rows],
                                    "planner_stored_mib": stored / 2**20, "planner_loss_mib": loss / 2**20,
                                    "losses": [r.losses for r in rows]}
    return out


def _ranks(folder: Path) -> list[RankResult]:
    """Every rank's result in a layout's folder, in rank order."""
    return [RankResult.from_json(p) for p in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


def load(root: Path, name: str) -> list[RankResult]:
    """Every rank's result of one layout (rank order), each with its final weights."""
    rows = []
    for folder in sorted(root.glob(f"workers*/{name}")):  # one folder: a layout runs in one launch
        for row in _ranks(folder):
            with np.load(folder / f"weights_rank{row.rank}.npz") as z:
                rows.append(replace(row, weights=dict(z)))
    if not rows:
        raise LabkitError(f"no results of layout '{name}' under {root}", "run parallel_runs() first")
    return rows


def gathered(rows: list[RankResult]) -> dict:
    """The full model from a layout's workers: tensor-parallel slices joined, pipeline stages merged (the first
    data- and context-parallel replica; every replica holds the same weights). An optimizer-parallel worker keeps
    only a slice of the weights, and gathers the full weights to save them (labkit.byhand.optimizer_parallel)."""
    full, lay = {}, rows[0].layout
    replica = [r for r in rows if r.place.dp == 0 and r.place.cp == 0]  # cp workers hold the same weights too
    for name in {n for r in replica for n in r.weights}:
        parts = [r.weights[name] for r in replica if name in r.weights]
        full[name] = scratch.unshard(name, parts, lay.vocab) if lay.tp > 1 else parts[0]
    return full


def tolerances(root: Path) -> dict:
    f32, f64 = load(root, "single_float32")[0], load(root, "single_float64")[0]
    d_loss = max(abs(a - b) for a, b in zip(f32.losses, f64.losses, strict=True))
    d_w = max(float(np.abs(f32.weights[k] - f64.weights[k]).max()) for k in f32.weights)
    ulp = float(np.spacing(np.float32(max(f32.losses))))
    return {"float32_vs_float64_loss": d_loss, "float32_vs_float64_weight": d_w,
            "loss": 4 * d_loss + 2 * ulp, "weight": 4 * d_w}


@dataclass(frozen=True)
class LayoutRun:
    """One layout's run against the float32 single-card run (`compare`)."""
    layout: HandLayout
    workers: int
    loss_diff: float  # the largest difference of a step's loss
    weight_diff: float  # the largest difference of a final weight, the workers' weights gathered
    same_names: bool  # the gathered weights are the single card's, by name
    equal: bool  # both differences within the tolerances
    per_worker: tuple[RankResult, ...]  # every worker's result, in rank order


def compare(root: Path | None = None) -> dict:
    """The tolerances (`tolerances`), the float32 single-card run under "reference" (a RankResult), and under
    "layouts" a `LayoutRun` per layout: the largest loss and final-weight differences from the reference, whether
    both are within the tolerances, and each worker's result (what it held and sent)."""
    root = root or parallel_runs("cached")
    tol = tolerances(root)
    ref = load(root, "single_float32")[0]
    out = {}
    for workers in sorted(runs.LAYOUTS):
        for lay in runs.LAYOUTS[workers]:
            rows = load(root, lay.name)
            full = gathered(rows)
            last = rows[-1]  # the last stage's (or any worker's) losses: every worker reports the global loss
            loss_diff = max(abs(a - b) for a, b in zip(last.losses, ref.losses, strict=True))
            weight_diff = max(float(np.abs(full[k] - ref.weights[k]).max()) for k in ref.weights)
            out[lay.name] = LayoutRun(lay, workers, loss_diff, weight_diff, sorted(full) == sorted(ref.weights),
                                      loss_diff <= tol["loss"] and weight_diff <= tol["weight"], tuple(rows))
    return {"tolerance": tol, "reference": ref, "layouts": out}


def resumed(root: Path | None = None) -> dict:
    """Per resume of the launches (runs.RESUMES): the largest differences of its continued steps' losses and of
    its final weights from the uninterrupted run of its source layout, and whether both are within the tolerances."""
    root = root or parallel_runs("cached")
    tol, out = tolerances(root), {}
    for r in (r for rs in runs.RESUMES.values() for r in rs):
        src, rows = load(root, r.source), load(root, r.name)
        want, got = gathered(src), gathered(rows)
        loss = max(abs(a - b) for a, b in zip(rows[-1].losses, src[-1].losses[runs.RESUME_AT:], strict=True))
        weight = max(float(np.abs(got[k] - want[k]).max()) for k in want)
        out[r.name] = {"source": r.source, "target": r.target, "loss_diff": loss, "weight_diff": weight,
                       "equal": loss <= tol["loss"] and weight <= tol["weight"], "steps": len(rows[-1].losses)}
    return {"tolerance": tol, "resumes": out}


# ------------------------------------------------------------------------------------------ against the planner


def planner_lines(lay: HandLayout, stage: int = 0) -> dict:
    """The planner's bytes per worker (float32 weights, gradients and AdamW moments, memory.model_states with the
    O0 census) for a layout, on pipeline stage `stage` (memory.stage_at). ZeRO (Rajbhandari et al.) is not a
    MindSpore mode: for zero1 and zero2 the planner's unsharded lines with the moments divided by dp, ZeRO-1's own
    accounting. The optimizer-parallel layouts
    (opt_level) are MindSpore's levels: the planner's sharded lines, with the gathered weights."""
    cfg = runs.model_cfg()
    st = stage_at(cfg, lay.pp, stage)
    level = lay.opt_level
    layout = Layout(dp=lay.dp, mp=lay.tp, pp=lay.pp, accum=lay.micro, optimizer_shard=bool(level),
                    optimizer=OptimizerParallel(level=f"level{level or 1}"))
    s = model_states(cfg, layout, CPU, st)
    out = {"params": s["weights"], "grads": s["gradients"],
           "optimizer": s["optimizer"] / (lay.dp if lay.zero else 1)}
    return {**out, "gathered": s["copies"]} if level else out


# Where the lab's hand-written layouts hold something else than the planner counts, and why (bytes per worker).
def explained(lay: HandLayout, place: Place | None = None) -> dict:
    """What the planner's lines leave out or count differently for this layout on the worker at `place` (default:
    the first stage): {term: bytes the measurement holds more (+) or less (-) than the planner}, each for a stated
    cause."""
    cfg = runs.model_cfg()
    place = place or lay.place(0)
    vocab_h = cfg.vocab_size * cfg.hidden_size
    out = {}
    cut = 4 * vocab_h * (1 - 1 / lay.tp)  # bytes of one vocabulary table a worker does not hold under tp
    embedding, head = place.pp == 0, place.pp == lay.pp - 1  # which of the two this worker's stage holds
    if lay.tp > 1 and lay.vocab and embedding:
        # the planner keeps the embedding whole on every worker (mindformers' default vocab_emb_dp: True); the lab's
        # vocabulary-parallel embedding holds 1/tp of its rows (vocab_emb_dp: False, Megatron's VocabParallelEmbedding)
        out.update({"params": -cut, "grads": -cut, "optimizer": -2 * cut})
    elif lay.tp > 1 and not lay.vocab and not cfg.tie_word_embeddings and head:
        # the planner splits the output layer over mp (a vocabulary-parallel head, as mindformers does); a layout
        # with vocab=False keeps the head whole on every worker
        out.update({"params": cut, "grads": cut, "optimizer": 2 * cut})
    if lay.zero == 2:
        # ZeRO-2 keeps 1/dp of the gradients; the planner models optimizer sharding only (ZeRO-1)
        every = 4 * sum(int(np.prod(s)) for s in scratch.shapes(cfg).values())
        out["grads"] = -(every - every / lay.dp)
    if lay.zero:
        # ZeRO's flat buffer is padded to a multiple of dp elements: at most dp - 1 elements of 8 bytes more
        out.setdefault("optimizer", 0.0)
    level = lay.opt_level
    if level:
        # mindformers creates the embedding and the RMSNorm weights with parallel_optimizer=False (the census), so
        # MindSpore keeps them whole; the lab's units shard them like every other weight, and gather them too
        shapes = scratch.shapes(cfg)
        whole = 4 * sum(int(np.prod(v)) for n, v in shapes.items() if "embedding" in n or len(v) == 1)
        half = whole * (1 - 1 / lay.dp)
        out.update({"params": -half, "optimizer": -2 * half})
        if level > 1:
            out["grads"] = -half  # the accumulation buffer is sharded from level2 on
        if level < 3:
            out["gathered"] = whole
        else:
            # the planner keeps one layer's gathered matrices beside the head's; the lab's regather holds one unit
            # at a time, the largest being the final norm with the head
            layer = 4 * sum(int(np.prod(v)) for n, v in shapes.items()
                            if n.startswith("model.layers.0.") and len(v) == 2)
            out["gathered"] = 4 * cfg.hidden_size - layer
    return out


def against_planner(result: dict) -> list[dict]:
    """One row per layout, worker and term: measured bytes, the planner's, the explained difference, what is left
    (the optimizer-parallel layouts add the gathered weights at their peak)."""
    rows = []
    for name, row in result["layouts"].items():
        lay = row.layout
        for w in row.per_worker:
            plan, why = planner_lines(lay, w.place.pp), explained(lay, w.place)
            for term in plan:
                measured = getattr(w.held, term)
                rows.append({"layout": name, "rank": w.rank, "term": term, "measured": measured,
                             "planner": plan[term], "explained": why.get(term, 0.0),
                             "unexplained": measured - plan[term] - why.get(term, 0.0)})
    return rows


# Per dimension, the operations whose bytes the textbook's volume (`textbook_bytes`) counts.
MAIN_OPS = {dim: d.textbook for dim, d in DIMENSIONS.items() if d.textbook}


def textbook_bytes(lay: HandLayout, settings: dict = runs.SETTINGS, place: Place | None = None) -> dict:
    """Bytes the worker at `place` (default: rank 0's) sends per step by the textbook (ring collectives, p workers in
    the group), per dimension: tensor parallel 2 all-reduces of b·s·h per layer of its stage forward and 2
    backward; sequence parallel the same volume as all-gathers and reduce-scatters; data parallel one all-reduce of
    its gradients (ZeRO: reduce-scatter + all-gather, the same volume; ZeRO-2 with m micro-steps reduce-scatters m
    times; optimizer parallel all-gathers the weights for every micro-step's forward, again for its backward at
    level3, and reduce-scatters the gradients once (level1) or every micro-step (level2/3)); pipeline b·s·h
    (b·s/t·h under SP) per micro-batch and boundary: activations forward from every stage but the last, gradients
    back from every stage but the first; the vocabulary-parallel embedding (first stage) an all-reduce of b·s·h
    forward, the head (last stage) one backward and the loss's two small collectives over b·s tokens. Context
    parallel: b·s is this worker's s/cp tokens, the gradients are summed over dp x cp, and the ring's or Ulysses'
    bytes are `cp_bytes`. A pipeline stage runs each forward twice (once to send its output, again under autodiff
    for the backward: full recompute, labkit.byhand.pipeline_parallel), and so every forward collective."""
    cfg = runs.model_cfg(settings)
    place = place or lay.place(0)
    shard = stage_shard(cfg, lay, lay.rank_at(place.dp, place.pp, place.tp, place.cp))
    s, h, g = settings["seq_len"] // lay.cp, cfg.hidden_size, settings["global_batch"]  # s: this worker's tokens
    embedding, head = shard.first(cfg), shard.last(cfg)
    ring = lambda p: 2 * (p - 1) / p  # noqa: E731  all-reduce bytes per byte of the tensor
    act = g // lay.dp * s * h * 4  # one [b, s, h] float32 tensor of this worker's batch (its s/cp tokens)
    fwd = 2 if lay.pp > 1 else 1  # forwards per micro-batch (the pipeline recomputes)
    out = {}
    if lay.tp > 1:  # per layer 2 collectives in each forward, 2 in the backward
        out["sp" if lay.sp else "tp"] = (2 * fwd + 2) * len(shard.layers(cfg)) * ring(lay.tp) * act
    if lay.dp * lay.cp > 1:  # the gradients of what this worker holds: its stage, tensor-parallel slices 1/tp
        shapes = scratch.shapes(cfg)
        per = 4 * sum(int(np.prod(shapes[n])) / (lay.tp if shard.splits(n) else 1) for n in scratch.names(cfg, shard))
        out["zero" if lay.zero else "dp"] = ring(lay.dp * lay.cp) * per  # over dp x cp with context parallel
        if lay.zero == 2:  # with accumulation ZeRO-2 reduce-scatters at every micro-step, to keep 1/dp of them
            out["zero"] = (lay.micro + 1) * (lay.dp - 1) / lay.dp * per
        level, m = lay.opt_level, lay.micro
        if level:  # all-gathers and reduce-scatters of the weights' size, (p - 1)/p of it each
            del out["dp"]
            out["opt"] = (m * (2 if level == 3 else 1) + (1 if level == 1 else m)) * (lay.dp - 1) / lay.dp * per
    if lay.tp > 1 and lay.vocab:
        # the embedding's partial lookups summed forward, the head input's gradient summed backward (b·s·h each);
        # the loss: an all-gather of every worker's row maxima, an all-reduce of [2, b·s] (target logit, sum of exp)
        tokens = g // lay.dp * s * 4
        out["vocab"] = embedding * fwd * ring(lay.tp) * act + head * (ring(lay.tp) * act + fwd * (
            (lay.tp - 1) * tokens + ring(lay.tp) * 2 * tokens))
    if lay.pp > 1:  # m micro-batches of b/m: one whole batch's activations forward, its gradients back
        out["pp"] = ((not head) + (not embedding)) * act / (lay.tp if lay.sp else 1)
    if lay.cp > 1:
        out["cp"] = cp_bytes(lay, cfg, act) * len(shard.layers(cfg))
    return out


def cp_bytes(lay: HandLayout, cfg, act: float) -> float:
    """Context parallel's bytes per layer and step from one worker, `act` its [b, s/cp, h] float32 tensor
    (labkit.byhand.context_parallel), its heads and kv heads those of a tensor-parallel worker (1/tp of each):
    the ring passes its key/value block [2, b, kv, s/cp, d] cp - 1 times forward, and the gradients as many times
    back (a point-to-point send of the block each); Ulysses' 4 all-to-alls forward (q, k, v: sequence split to
    head split; the context back) and their 4 reverses backward each send (cp - 1)/cp of the worker's tensor."""
    kv = act * cfg.kv_heads / cfg.num_heads / lay.tp  # one of k or v of this worker: its kv heads' share of act
    if lay.cp_algo == "ring":
        return 2 * (lay.cp - 1) * 2 * kv
    return 2 * (lay.cp - 1) / lay.cp * (2 * act / lay.tp + 2 * kv)


def comm_rows(result: dict, settings: dict = runs.SETTINGS) -> list[dict]:
    """Per layout, worker and dimension, bytes sent per step: the textbook's, as counted at the collectives (what
    the real operation sends, and what its CPU stand-in sent), and what the process read and wrote (/proc/self/io:
    every collective of the step, both directions)."""
    rows, steps = [], settings["steps"]
    for name, row in result["layouts"].items():
        for w in row.per_worker:
            for dim, expect in textbook_bytes(row.layout, settings, w.place).items():
                ops = [w.traffic[k] for k in MAIN_OPS[dim] if k in w.traffic]
                rows.append({"layout": name, "rank": w.rank, "dimension": dim, "textbook": expect,
                             "counted": sum(o.ideal_bytes for o in ops) / steps,
                             "cpu_stand_in": sum(o.sent_bytes for o in ops) / steps,
                             "io_per_step": w.io_bytes / steps})
    return rows


# ------------------------------------------------------------------------------------------ what a strategy rests on

# Each dimension a strategy may use, the layout of the lab that trained it on CPU workers, and where it is taught.
EVIDENCE = (("data_parallel", lambda s: s.dp > 1, "dp2", "05, 06a §4"),
            ("model_parallel", lambda s: s.mp > 1, "tp2", "06a §2-§4"),
            ("use_seq_parallel", lambda s: s.sequence_parallel, "sp2", "06a §3-§4"),
            ("data_parallel x model_parallel", lambda s: s.dp > 1 and s.mp > 1, "dp2_tp2", "06a §4"),
            ("pipeline_stage + micro_batch_num", lambda s: s.pp > 1, "pp2_1f1b", "06b §1"),
            ("data_parallel x model_parallel x pipeline_stage", lambda s: s.dp > 1 and s.mp > 1 and s.pp > 1,
             "dp2_tp2_pp2", "06b §1"),
            ("optimizer_shard", lambda s: s.optimizer_shard, "opt1", "06b §2"),
            ("context_parallel (colossalai_cp: the ring)", lambda s: s.cp > 1 and s.ring > 1, "cp2_ring", "06d §2"),
            ("context_parallel (ulysses_cp)", lambda s: s.cp > 1 and s.ulysses > 1, "cp2_ulysses", "06d §2"))


def evidence(layout, root: Path = CACHE) -> list[dict]:
    """For each parallel dimension: whether `layout` (a labkit.layout.Layout) uses it, the lab run that trained it
    on CPU workers and how far that run was from one card (when its results are cached and the code that
    made them is unchanged; otherwise where to run it)."""
    try:
        result = compare(parallel_runs("cached", root))
    except LabkitError:
        result, missing = None, "not run here yet: run notebook 06a (or parallel_lab.parallel_runs())"
    rows = []
    for key, used, lab, where in EVIDENCE:
        row = {"mindformers parallel_config": key, "used": used(layout), "shown by": f"{lab} (notebook {where})"}
        if result:
            r = result["layouts"][lab]
            row.update({"max |loss - one card|": r.loss_diff, "max |weight - one card|": r.weight_diff,
                        "equal to one card": r.equal})
        else:
            row["equal to one card"] = missing
        rows.append(row)
    return rows
