"""What only notebook 06d needs of context parallelism by hand (labkit.byhand.context_parallel) beyond the runs
06a shares (labkit.course.parallel_lab): the ring's idle work per worker, and the planner's context-parallel
memory line against the memory probe's by-hand workers.

    rows = ring_idle(parallel_lab.compare(root))            # per ring worker: work, idle work, as time
    rows = cp_memory(parallel_lab.memory_runs())            # per cp layout: the saving, planned and measured

The planner's cp term (labkit.parallel.cp_terms.attention_elements, inside memory.layer_activations) assumes flash
attention, as mindformers does (it refuses cp without it): nothing of size s x s is stored, only two softmax
statistics per query row and head, K and V at their own (key/value-head) width, and for Ulysses the attention output
in the head split, which flash attention's backward reads. The by-hand attention on CPU has no flash kernel: it
materialises its scores. `materialised_attention` is that difference, named and counted from the blocks each worker
computes, in the planner's own convention for attention without flash attention (memory.layer_activations with
flash_attention False: one stored copy of every score, K and V repeated for the query heads):

  scores    one copy of every score block the worker computes: a x s x s per sequence on one card, the (2cp+1)
            blocks of c x c of the zigzag split on a ring worker (c = s / 2cp; context_parallel.work), heads / u
            heads of s x s on a Ulysses worker;
  K, V      repeated for the query heads for every block read (the ring repeats each block it receives), in place of
            the K and V at key/value width the planner counts;
  running   the ring's online softmax rescales a query chunk's running output once per block after its first;
  minus     flash attention's statistics (2 per query row and head) and, for Ulysses, its stored output (the
            materialised attention's backward reads the probabilities instead).

The saving of a cp worker over one card is then the planner's activation line (memory.memory_breakdown at the
probe's shape, float32, unfused norm and SiLU as on CPU) plus the named term, each one card's minus the worker's;
it is held to the planner calibration's target (bench/plan_calibration.py TARGET), as the planner's other memory
differences are."""
from __future__ import annotations

from pathlib import Path

from labkit.byhand import context_parallel as cpl
from labkit.byhand import runs
from labkit.byhand.worker import HandLayout
from labkit.course import parallel_lab
from labkit.errors import LabkitError
from labkit.layout import Layout
from labkit.parallel.memory import GIB, Numerics, memory_breakdown
from labkit.training.metrics import pool_peaks_mb

# the probe's workers compute in float32 with unfused norms and SiLU (CPU); flash attention: the planner's cp term
FLASH_CPU = Numerics(amp_level="O0", flash_attention=True, fused_norm=False, fused_silu=False)
MIB = 2**20


def ring_idle(result: dict, settings: dict = runs.SETTINGS) -> list[dict]:
    """Per ring layout and worker, over the run (every layer and step): the attention score elements it computed,
    the work it waited for at the ring's passes (context_parallel.idle_units: each step's busiest worker's minus
    its own), with the zigzag split it ran (from its records) and with the contiguous split (counted: `ring_units`
    scaled by the sequences x heads x layers x steps it computed for), and both as time at the cost per score
    element its cp group measured (the forward's block computations over their units; an illustration: wall time on
    a shared CPU, forward only). A unit is one score of one sequence and head: d multiply-adds for q·k and d for the
    probabilities times v."""
    cfg, rows = runs.model_cfg(settings), []
    for name, row in result["layouts"].items():
        lay = row.layout
        if lay.cp == 1 or lay.cp_algo != "ring":
            continue
        cp, c = lay.cp, settings["seq_len"] // (2 * lay.cp)
        scale = settings["global_batch"] // lay.dp * cfg.num_heads // lay.tp * cfg.num_layers * settings["steps"]
        naive = [[u * scale for u in step] for step in cpl.ring_units(cp, c, balanced=False)]
        for dp_tp in sorted({(w.place.dp, w.place.tp) for w in row.per_worker}):
            group = sorted((w for w in row.per_worker if (w.place.dp, w.place.tp) == dp_tp), key=lambda w: w.place.cp)
            ran = [[w.ring[t].units for w in group] for t in range(cp)]
            took = [[w.ring[t].seconds for w in group] for t in range(cp)]
            cost = sum(s.seconds for w in group for s in w.ring) / sum(s.units for w in group for s in w.ring)
            zig_idle, naive_idle, zig_waited = cpl.idle_units(ran), cpl.idle_units(naive), cpl.idle_units(took)
            for i, w in enumerate(group):
                rows.append({"layout": name, "rank": w.rank, "units": sum(s.units for s in w.ring),
                             "zigzag idle units": zig_idle[i], "naive units": sum(step[i] for step in naive),
                             "naive idle units": naive_idle[i], "ns per unit": cost * 1e9,
                             "zigzag idle ms": zig_idle[i] * cost * 1e3, "naive idle ms": naive_idle[i] * cost * 1e3,
                             "zigzag waited ms (measured)": zig_waited[i] * 1e3})
    return sorted(rows, key=lambda r: (r["layout"], r["rank"]))


def planner_layout(lay: HandLayout, settings: dict = runs.MEMORY_SETTINGS) -> Layout:
    """The planner's Layout of a by-hand cp layout of the probe (dp and tp 1): the ring is colossalai_cp, Ulysses
    ulysses_cp; the probe's whole batch is one micro-batch."""
    algo = "ulysses_cp" if lay.cp_algo == "ulysses" else "colossalai_cp"
    return Layout(cp=lay.cp, cp_algo=algo, micro_batch=settings["global_batch"])


def planner_activations(lay: HandLayout, settings: dict = runs.MEMORY_SETTINGS) -> float:
    """Bytes of the planner's activation line (memory.memory_breakdown, flash attention) for one worker of `lay`."""
    cfg = runs.model_cfg(settings)
    return memory_breakdown(cfg, planner_layout(lay, settings), seq_len=settings["seq_len"],
                            numerics=FLASH_CPU)["activations"] * GIB


def materialised_attention(lay: HandLayout, settings: dict = runs.MEMORY_SETTINGS) -> dict[str, float]:
    """The named term (module docstring): bytes the by-hand attention of one worker of `lay` stores beyond what
    the planner's flash-attention count holds, by part, every layer together (float32)."""
    cfg = runs.model_cfg(settings)
    s, b, cp = settings["seq_len"], settings["global_batch"], lay.cp
    a, d, kv = cfg.num_heads, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    s_c = s // cp  # the tokens a worker holds outside attention
    if cp > 1 and lay.cp_algo == "ring":
        c = s // (2 * cp)
        blocks = cpl.work(cp)[0]  # every worker the same under zigzag
        heads, rows_cols, cols, running = a, blocks * c * c, blocks * c, (blocks - 2) * b * a * d * c
    else:  # one card, or Ulysses: whole sequences over a / cp heads
        heads, rows_cols, cols, running = a // cp, s * s, s, 0
    parts = {"scores": heads * b * rows_cols,
             "K, V repeated for the heads": 2 * b * heads * d * cols - 2 * s_c * b * kv,
             "running output": running,
             "flash statistics": -2 * a * s_c * b,
             "flash output (Ulysses)": -s_c * b * a * d if cp > 1 and lay.cp_algo == "ulysses" else 0}
    return {k: 4.0 * cfg.num_layers * v for k, v in parts.items()}


def live_peak_mib(folder: Path, name: str) -> float:
    """The largest live-pool peak (MiB, "peak used mem": the most tensor bytes live at once) over the workers of the
    probe's launch of layout `name` (labkit.training.metrics.pool_peaks_mb; the address span adds placement holes
    no count predicts, so the planner's calibration compares live peaks too)."""
    peaks = [pool_peaks_mb(log.read_text(errors="replace")) for log in sorted((folder / name / "logs").glob("worker_*.log"))]
    if not peaks or None in peaks:
        raise LabkitError(f"no memory-pool statistics in {folder / name / 'logs'}", "run parallel_lab.memory_runs('run')")
    return max(p["live"] for p in peaks)


def cp_memory(folder: Path | None = None, settings: dict = runs.MEMORY_SETTINGS) -> list[dict]:
    """Per cp layout of the memory probe (`folder`: parallel_lab.memory_runs' folder): what a worker saves against
    one card (MiB), measured (the live pool peaks' difference, the busiest worker) and planned, before (the
    planner's activation line alone) and after the named term, with the relative errors."""
    if folder is None:
        folder = parallel_lab.memory_runs("cached")
    by_name = {lay.name: lay for lay in runs.MEMORY_LAYOUTS}
    one = by_name["single"]
    plan_one, named_one = planner_activations(one, settings), sum(materialised_attention(one, settings).values())
    rows = []
    for name in ("cp2_ring", "cp2_ulysses"):
        lay = by_name[name]
        measured = live_peak_mib(folder, "single") - live_peak_mib(folder, name)
        planned = (plan_one - planner_activations(lay, settings)) / MIB
        named = (named_one - sum(materialised_attention(lay, settings).values())) / MIB
        rows.append({"layout": name, "measured MiB": measured, "planner (flash) MiB": planned,
                     "materialised attention MiB": named, "planner + named MiB": planned + named,
                     "error before": planned / measured - 1, "error after": (planned + named) / measured - 1})
    return rows
