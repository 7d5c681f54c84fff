"""Reading a run's metrics.jsonl and judging its health (the first-steps check the course teaches)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from labkit.io import atomic_write_text

# MindSpore prints its memory-pool statistics at exit with MS_DEV_RUNTIME_CONF=memory_statistics:True.
# On CPU the pool holds a step's live tensors (activations, gradients); process RSS also carries graph compilation
# and allocator caches, and max_memory_allocated() returns 0.
# Two peaks, both in whole MiB, rounded down (integer division by 2**20 in MindSpore's mem_dynamic_allocator.cc):
#   "peak used mem": the most bytes of tensors live at once (UsedMemPeakStatistics, sizes rounded up to 512 bytes);
#   "actual peak used mem": the span of addresses the pool handed out (ActualPeakStatistics, max - min address of
#   its blocks), i.e. the live bytes plus the holes its best-fit placement left between them.
POOL_STATS_ENV = {"MS_DEV_RUNTIME_CONF": "memory_statistics:True"}
_POOL_RE = re.compile(r"dynamic memory pool.*?actual peak used mem:(\d+)M")
_POOL_BOTH_RE = re.compile(r"dynamic memory pool.*?, peak used mem:(\d+)M, actual peak used mem:(\d+)M")


def pool_peak_mb(log_text: str) -> float | None:
    """The last memory-pool peak MindSpore printed (MB, the address span: "actual peak used mem"), or None."""
    found = _POOL_RE.findall(log_text)
    return float(found[-1]) if found else None


def pool_peaks_mb(log_text: str) -> dict | None:
    """The last memory-pool statistics MindSpore printed, in MiB: `live` (the most tensor bytes live at once) and
    `span` (the address span, live bytes plus placement holes); None when not printed."""
    found = _POOL_BOTH_RE.findall(log_text)
    return {"live": float(found[-1][0]), "span": float(found[-1][1])} if found else None


def read_metrics(run_dir) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`; a line still being written (not yet valid JSON) is skipped."""
    try:
        text = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def health(history: list[dict], grad_norm_alert: float = 10.0) -> dict:
    """What to look at in the first ~100 steps: is the loss falling, is the gradient norm tame, any NaN/overflow?"""
    if not history:
        return {"steps": 0, "verdict": "no steps"}
    losses = [r["loss"] for r in history]
    norms = [r["grad_norm"] for r in history]
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    spikes = [r["step"] for r in history if r["grad_norm"] > grad_norm_alert]
    bad = [r["step"] for r in history if not math.isfinite(r["loss"])]
    falling = last < first
    verdict = "healthy" if falling and not bad and len(spikes) <= len(history) // 10 else "check"
    return {"steps": len(history), "loss_first": round(first, 4), "loss_last": round(last, 4),
            "loss_falling": falling, "grad_norm_max": round(max(norms), 3),
            "grad_norm_median": round(sorted(norms)[len(norms) // 2], 3), "grad_norm_alerts": spikes,
            "non_finite_steps": bad, "overflows": history[-1].get("overflows", 0), "verdict": verdict}


# The one steady-throughput definition (trainer summary, run comparison, benches). Step 1 compiles the graph;
# MindSpore's CPU element-wise kernels tune their task count over their first calls (steps 2-5 of the tiny run
# ~40% slower than step 6 on), so the first WARMUP_STEPS steps are left out of every throughput figure.
WARMUP_STEPS = 5


def steady_window(values: list, warmup: int = WARMUP_STEPS) -> list:
    """The values after warm-up; a run too short for that keeps what follows its first (compiling) step."""
    return list(values[warmup:] or values[1:] or values)


def steady_stats(values: list[float], warmup: int = WARMUP_STEPS) -> dict:
    """Median of the steady window with its spread: quartiles, min, max, and (q3 - q1) / median as `rel_iqr`.
    The median, not the mean: a shared machine's stalls only ever lengthen a step, and one stall would move
    a mean but not a median."""
    import statistics

    w = sorted(float(v) for v in steady_window(values, warmup))
    if not w:
        return {"n": 0, "median": None}
    med = statistics.median(w)
    q1, _, q3 = statistics.quantiles(w, n=4, method="inclusive") if len(w) > 1 else (w[0], w[0], w[0])
    return {"n": len(w), "median": med, "q1": q1, "q3": q3, "min": w[0], "max": w[-1],
            "rel_iqr": (q3 - q1) / med if med else None}


def steady(history: list[dict], key: str, skip: int = WARMUP_STEPS) -> float | None:
    """Median of `key` over the steady window (see steady_stats)."""
    return steady_stats([r[key] for r in history], skip)["median"]


def steady_throughput(history: list[dict], warmup: int = WARMUP_STEPS) -> dict:
    """tokens/s of the median steady step (tokens per step / median step time) and the step time's spread."""
    stats = steady_stats([r["step_time_s"] for r in history], warmup)
    if not stats["n"]:
        return {"tokens_per_s": None, "step_time": stats}
    tokens = history[-1]["tokens_per_s"] * history[-1]["step_time_s"]
    return {"tokens_per_s": tokens / stats["median"], "step_time": stats}


def rewrite_metrics(out: Path, history: list[dict]):
    atomic_write_text(Path(out) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
