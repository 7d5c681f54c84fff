"""The parallel-strategy planner: memory and time per device for every dp x mp x pp x cp split, context-parallel
algorithm, micro-batch, accumulation, recomputation and optimizer sharding; the best one as mindformers YAML and an
msrun command (`labkit plan`: labkit.parallel.plan_cli).

Memory per device: labkit.parallel.memory (weights, gradients, optimizer states, activations, overhead).
Time per step: FLOPs (6 N per token + the attention term, recompute adds its forward) over peak x efficiency,
plus tensor-parallel all-reduces, pipeline sends, context-parallel key/value passes or all-to-alls
(labkit.parallel.cp_terms.comm_bytes) and the gradient all-reduce over dp x cp, over the preset's
bandwidths (not overlapped with compute), plus the pipeline bubble (p - 1) / m.
The same code models the CPU (precision fp32, no flash attention): bench/plan_calibration.py checks it there.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.layout import RECOMPUTE, Layout, OptimizerParallel, Recompute
from labkit.model.shapes import flops_per_token, num_params, param_counts
from labkit.parallel import cp_terms
from labkit.parallel.devices import GIB, Device, device_preset
from labkit.parallel.memory import Numerics, bytes_per_param, memory_breakdown, stage_params, wrapper_of

DEFAULT_EFFICIENCY = 0.5  # achievable fraction of peak for the matmuls (Megatron 44-52%, mindformers 7B ~53% MFU)
DEFAULT_GLOBAL_BATCH = 64  # sequences per step: mindformers' Llama-2-7B recipe (dp 8 x batch 1 x accum 8)
# GiB of MindSpore's memory pool (the device memory less the overhead: what max_device_memory gives it) a plan
# leaves free to fit: a chosen margin for the pool's fragmentation and the planner's error, not a measurement
FIT_MARGIN_GIB = 1.0


# ----------------------------------------------- backward tensors MindSpore computes during the forward pass
# MindSpore's kernel graph runs a kernel soon after its inputs exist (its launch order: MS_ALLOC_CONF=
# memory_tracker:True task.csv, against MS_DEV_SAVE_GRAPHS=1 graph_build_*.ir). Backward-pass and optimizer kernels
# whose inputs are all forward values therefore run during the forward pass, and their outputs stay live until the
# backward pass (or the optimizer update) reads them: at the activation peak (the end of the forward pass) they are
# extra tensors of the step. Measured on CPU (MindSpore 2.9,
# mindformers 1.9, bench/plan_calibration.py): replaying the graph's allocations in launch order gives the memory
# pool's peak to within its 1 MiB print resolution (81.6 MiB for 2 layers, 117.1 for 4, 148.7 at sequence 256).
# These terms depend on the graph only: the same on every x86 CPU, whatever kernels oneDNN picks for its ISA.
#   unfused RMSNorm (Square, ReduceMean, Rsqrt, Mul): Square's gradient factor 2 * x, one s*b*h tensor per norm;
#   SiLU without a SiLU kernel (MindSpore's expander writes x * Sigmoid(x) on CPU): SiLUGrad's Sigmoid(x), one
#     s*b*f tensor per layer (sequence-split by mp like the other SwiGLU tensors);
#   the loss: _NLLLoss.bprop's exp(log-softmax), counted in LOSS_FP32_COPIES;
#   mindformers AdamW: param_fp32 * (1 - lr * weight_decay) for every parameter (adamw_early_bytes), computed at
#     the start of the step and read by the update at its end. No gradient exists yet at the forward-pass peak: in
#     fp32 this product takes exactly the place (4 bytes per parameter) of the planner's gradient buffer.


# ------------------------------------------------------------------------------------- what a plan is for


@dataclass(frozen=True)
class Machine:
    """The devices a plan is for: how many, the memory of each, the device preset (peak FLOP/s, bandwidths, framework
    overhead) and the servers they sit in, with the preset's figures overridden where given."""

    devices: int
    device_memory_gib: float
    device: str | Device = "atlas_800t_a2"
    nodes: int | None = None  # None: as many as the preset's devices_per_node needs
    peak_tflops: float | None = None  # None: the preset's peak for the precision
    efficiency: float = DEFAULT_EFFICIENCY  # achievable fraction of peak
    overhead_gib: float | None = None  # None: the preset's


@dataclass(frozen=True)
class Setting:
    """What every candidate strategy of one plan() shares, validated (the machine, the batch, the assumptions)."""
    device: Device
    devices: int
    memory_gib: float  # per device
    nodes: int
    seq_len: int
    global_batch: int
    numerics: Numerics  # fused_norm and fused_silu: the device's
    peak_tflops: float
    efficiency: float
    sequence_parallel: bool
    overhead_gib: float
    constraints: dict  # pinned strategy keys (None = searched)
    optimizer: OptimizerParallel = OptimizerParallel()  # how a layout with optimizer_shard shards


@dataclass(frozen=True)
class Strategy:
    """One strategy the planner judged: its layout, memory per device by part (GiB: weights, gradients, optimizer,
    activations, overhead, total) on the most loaded `stage`, time per step (and by part), throughput, MFU, and
    whether it fits (if not, `why_not`)."""

    layout: Layout
    memory_gib: dict
    stage: str  # only, first or last
    params_per_device: int
    step_time_s: float
    time_s: dict  # by part: compute, bubble, tp_comm, pp_comm, cp_comm, dp_comm
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    fits: bool
    why_not: str | None = None

    dp = property(lambda self: self.layout.dp)
    mp = property(lambda self: self.layout.mp)
    pp = property(lambda self: self.layout.pp)
    cp = property(lambda self: self.layout.cp)
    micro_batch = property(lambda self: self.layout.micro_batch)
    accum = property(lambda self: self.layout.accum)
    optimizer_shard = property(lambda self: self.layout.optimizer_shard)

    @property
    def recompute(self) -> str:
        """The layout's recomputation as text: the planner's mode (none, selective, full), or `last:K` and the like."""
        return self.layout.row()["recompute"]

    def to_dict(self) -> dict:
        """As JSON holds it (`labkit plan --json`): the layout's keys, then the figures."""
        out = {**self.layout.row(), **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                       if f.name != "layout"}}
        return out if self.why_not else {k: v for k, v in out.items() if k != "why_not"}


# --------------------------------------------------------------------------------------------- time model


def step_time(cfg: ModelConfig, layout: Layout, st: Setting) -> dict:
    """Seconds per optimizer step, by part, and the throughput it implies. With only some layers recomputed, the
    parts of the planner's modes weighted (Recompute.planner_modes)."""
    parts: dict[str, float] = {}
    for mode, w in layout.recompute.planner_modes(cfg.num_layers).items():
        for k, v in _time_parts(cfg, layout, st, mode).items():
            parts[k] = parts.get(k, 0.0) + w * v
    devices, tokens = layout.devices, layout.global_batch * st.seq_len
    total = sum(parts.values())
    return {
        "step_time_s": total,
        "time_s": parts,
        "tokens_per_s": tokens / total,
        "tokens_per_s_per_device": tokens / total / devices,
        "mfu": tokens * flops_per_token(cfg, st.seq_len)["model"] / total / devices / (st.peak_tflops * 1e12),
    }


def _time_parts(cfg: ModelConfig, layout: Layout, st: Setting, recompute: str) -> dict[str, float]:
    """Seconds per step by part for one of the planner's modes, every layer alike."""
    dp, mp, pp, cp, accum = layout.dp, layout.mp, layout.pp, layout.cp, layout.accum
    act_bytes = st.numerics.act_bytes
    grad_bytes = bytes_per_param(st.numerics.amp_level, wrapper_of(layout))["gradients"]
    devices = layout.devices
    per_node = max(1, devices // st.nodes)
    tokens = layout.global_batch * st.seq_len
    fpt = flops_per_token(cfg, st.seq_len, recompute)
    compute = tokens * fpt["hardware"] / devices / (st.peak_tflops * 1e12 * st.efficiency)
    bubble = compute * (pp - 1) / accum
    layers = math.ceil(cfg.num_layers / pp)
    # one activation tensor of a micro-batch on one device: its s / cp tokens
    act_msg = layout.micro_batch * st.seq_len / cp * cfg.hidden_size * act_bytes
    bw = {True: st.device.intra_node_gbps * 1e9, False: st.device.inter_node_gbps * 1e9}
    tp = 0.0
    if mp > 1:  # 2 all-reduces forward, 2 backward per layer (Megatron); full recompute repeats the forward 2
        n_ar = 6 if recompute == "full" else 4
        tp = n_ar * 2 * (mp - 1) / mp * act_msg * layers * accum / bw[mp <= per_node]
    pp_t = 0.0
    if pp > 1:  # each micro-batch: activations forward, their gradients backward, across one stage boundary
        pp_t = 2 * accum * act_msg / (mp if layout.sequence_parallel else 1) / bw[devices <= per_node]
    cp_t = 0.0
    if cp > 1:  # the ring's key/value blocks and Ulysses' all-to-alls, every layer of every micro-batch; mindformers'
        # device matrix is (dp, cp, mp): the cp group's devices are mp apart
        c = cp_terms.comm_bytes(cfg, layout, st.seq_len, act_bytes, recompute)
        cp_t = (c["ring"] + c["all_to_all"]) * layers * accum / bw[mp * cp <= per_node]
    dp_t, replicas = 0.0, dp * cp  # the weights are replicated over dp x cp: their gradients are summed over it
    if replicas > 1:  # ring all-reduce of the gradients (sharded: reduce-scatter + all-gather, the same volume)
        params = max(s["params"] for s in stage_params(cfg, mp, pp).values())
        dp_t = 2 * (replicas - 1) / replicas * params * grad_bytes / bw[replicas * mp <= per_node]
    return {"compute": compute, "bubble": bubble, "tp_comm": tp, "pp_comm": pp_t, "cp_comm": cp_t, "dp_comm": dp_t}


# ------------------------------------------------------------------------------------------------- search


def plan(model_cfg: ModelConfig, machine: Machine, *, seq_len: int = 4096, global_batch: int | None = None,
         numerics: Numerics = Numerics(), sequence_parallel: bool = False, constraints: dict | None = None,
         optimizer: OptimizerParallel = OptimizerParallel()) -> dict:
    """Every strategy for the machine's devices, ranked by predicted throughput.

    numerics: the amp level, flash attention (the fused kernels are the device's).
    constraints: pin any of Layout.KEYS (dp, mp, pp, cp, cp_algo, ulysses_degree, micro_batch, accum, recompute,
        optimizer_shard; None = search it), except cp: 1 unless pinned, or searched over cp_terms.CP_DEGREES
        when cp is "search" or an algorithm is pinned (colossalai_cp and ulysses_cp; hybrid_cp only when pinned).
        Context parallelism is opt-in: the step-time model has one efficiency for every matmul, so it cannot see
        what a short per-device sequence (s/cp) costs, and at 4k tokens it would trade recompute for cp.
    optimizer: MindSpore's parallel-optimizer settings for the candidates that shard (optimizer_shard)."""
    st = setting(machine, seq_len=seq_len, global_batch=global_batch, numerics=numerics,
                 sequence_parallel=sequence_parallel, constraints=constraints, optimizer=optimizer)
    strategies, skipped = [], {}
    for cand, reason in candidates(model_cfg, st):
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            strategies.append(strategy_row(model_cfg, st, cand))
    strategies.sort(key=lambda r: (not r.fits, -r.tokens_per_s, r.memory_gib["total"]))
    return _result(model_cfg, st, strategies, skipped)


def setting(machine: Machine, *, seq_len: int, global_batch: int | None, numerics: Numerics,
            sequence_parallel: bool, constraints: dict | None,
            optimizer: OptimizerParallel = OptimizerParallel()) -> Setting:
    """plan()'s arguments checked, with the device preset's values filled in."""
    m = machine
    dev = m.device if isinstance(m.device, Device) else device_preset(m.device, measure=m.peak_tflops is None)
    numerics.dtypes  # noqa: B018 - an unknown amp level is refused here
    optimizer.check("optimizer")
    if m.devices < 1 or m.device_memory_gib <= 0:
        raise LabkitError(f"devices ({m.devices}) and device memory ({m.device_memory_gib} GiB) must be positive")
    global_batch = global_batch or DEFAULT_GLOBAL_BATCH
    if global_batch < 1 or seq_len < 1:
        raise LabkitError(f"global_batch ({global_batch}) and seq_len ({seq_len}) must be positive")
    nodes = m.nodes or max(1, math.ceil(m.devices / dev.devices_per_node))
    if m.devices % nodes:
        raise LabkitError(f"{m.devices} devices do not split evenly over {nodes} nodes",
                          "choose nodes dividing devices")
    peak = float(m.peak_tflops) if m.peak_tflops else dev.peak(numerics.precision)
    if not 0 < m.efficiency <= 1:
        raise LabkitError(f"efficiency {m.efficiency} must be in (0, 1]", "e.g. 0.5 for half of peak")
    numerics = dataclasses.replace(numerics, fused_norm=dev.name.startswith("atlas"),  # fused RMSNorm: Ascend only
                                   fused_silu=dev.name != "cpu")  # MindSpore 2.9 has no CPU SiLU: x * Sigmoid(x)
    return Setting(device=dev, devices=m.devices, memory_gib=m.device_memory_gib, nodes=nodes, seq_len=seq_len,
                   global_batch=global_batch, numerics=numerics, peak_tflops=peak, efficiency=m.efficiency,
                   sequence_parallel=sequence_parallel,
                   overhead_gib=dev.overhead_gib if m.overhead_gib is None else m.overhead_gib,
                   constraints=_check_constraints(constraints), optimizer=optimizer)


def candidates(cfg: ModelConfig, st: Setting):
    """(layout, None) for each candidate the constraints allow, or (layout, why it cannot run)."""
    g = st.global_batch
    for (dp, mp, pp, cp), (algo, ulysses) in _splits(st.devices, st.constraints):
        split = _invalid_split(cfg, g, dp, mp, pp)
        for mb in _divisors(g // dp) if g % dp == 0 else [None]:
            accum = g // dp // mb if mb else None
            for rc, osh in itertools.product(RECOMPUTE, (False, True) if dp * cp > 1 else (False,)):
                cand = Layout(dp=dp, mp=mp, pp=pp, cp=cp, cp_algo=algo, ulysses_degree=ulysses, micro_batch=mb,
                              accum=accum, recompute=Recompute(rc), optimizer_shard=osh,
                              sequence_parallel=st.sequence_parallel and mp > 1, optimizer=st.optimizer)
                row = cand.row()
                if any(st.constraints.get(k) is not None and row[k] != st.constraints[k] for k in Layout.KEYS):
                    continue
                why = split or cp_terms.invalid(cfg, cand, st.seq_len, st.numerics.flash_attention)
                yield cand, why or (f"pipeline needs micro-batches >= stages (accum {accum} < pp {pp})"
                                    if pp > 1 and accum < pp else None)


def strategy_row(cfg: ModelConfig, st: Setting, layout: Layout) -> Strategy:
    """One strategy: memory per device by part, time per step by part, throughput, MFU, whether it fits."""
    mem = memory_breakdown(cfg, layout, seq_len=st.seq_len, numerics=st.numerics, overhead_gib=st.overhead_gib)
    t = step_time(cfg, layout, st)
    parts = {k: v for k, v in mem.items() if k not in ("stage", "params")}
    return Strategy(layout=layout, memory_gib=_rounded(parts), stage=mem["stage"], params_per_device=int(mem["params"]),
                    step_time_s=round(t["step_time_s"], 4), time_s=_rounded(t["time_s"], 4),
                    tokens_per_s=round(t["tokens_per_s"], 1),
                    tokens_per_s_per_device=round(t["tokens_per_s_per_device"], 1), mfu=round(t["mfu"], 4),
                    fits=mem["total"] + FIT_MARGIN_GIB <= st.memory_gib, why_not=why_not(mem, st.memory_gib))


def why_not(mem: dict, memory_gib: float) -> str | None:
    """Why a strategy with memory breakdown `mem` (GiB by part) does not fit in `memory_gib` with FIT_MARGIN_GIB to
    spare; None when it fits."""
    if mem["total"] + FIT_MARGIN_GIB <= memory_gib:
        return None
    return (f"needs {mem['total']:.1f} GiB + {FIT_MARGIN_GIB:g} margin > {memory_gib:g} GiB: model states "
            f"{states_gib(mem):.1f} + weight copies {mem['copies']:.1f} + activations {mem['activations']:.1f} + "
            f"overhead {mem['overhead']:.1f}")


def states_gib(mem: dict) -> float:
    """Weights, gradients and optimizer states of a memory breakdown (GiB)."""
    return mem["weights"] + mem["gradients"] + mem["optimizer"]


def numerics_of(result: dict) -> Numerics:
    """The Numerics a plan() result was computed with."""
    a = result["assumptions"]
    return Numerics(amp_level=result["amp_level"], flash_attention=result["flash_attention"],
                    fused_norm=a["fused_norm"], fused_silu=a["fused_silu"])


def layer_line(cfg: ModelConfig, result: dict, strategy: Strategy) -> dict[str, float]:
    """Bytes one decoder layer adds to the strategy's memory per device, by part: the planner's figure for the model
    minus its figure for the same model with one layer fewer (same strategy and assumptions, not rounded). With
    pp > 1 this is the layer's share on the most loaded stage."""
    kw = dict(seq_len=result["seq_len"], numerics=numerics_of(result))
    whole = memory_breakdown(cfg, strategy.layout, **kw)
    fewer = memory_breakdown(dataclasses.replace(cfg, num_layers=cfg.num_layers - 1), strategy.layout, **kw)
    return {k: (whole[k] - fewer[k]) * GIB for k in ("weights", "gradients", "optimizer", "copies", "activations")}


def _result(cfg: ModelConfig, st: Setting, strategies: list, skipped: dict) -> dict:
    best = next((r for r in strategies if r.fits), None)
    n = st.numerics
    bpp = bytes_per_param(n.amp_level)
    result = {
        "model": cfg.name, "params": num_params(cfg), "param_counts": param_counts(cfg),
        "devices": st.devices, "nodes": st.nodes, "device": st.device.name, "device_memory_gib": st.memory_gib,
        "seq_len": st.seq_len, "global_batch": st.global_batch, "tokens_per_step": st.global_batch * st.seq_len,
        "amp_level": n.amp_level, "precision": n.precision, "peak_tflops": st.peak_tflops, "efficiency": st.efficiency,
        "flash_attention": n.flash_attention,
        "assumptions": {
            "bytes_per_param": bpp, "model_states_gib_unsharded": round(num_params(cfg) * bpp["total"] / GIB, 2),
            "overhead_gib": st.overhead_gib, "fused_norm": n.fused_norm, "fused_silu": n.fused_silu,
            "sequence_parallel": st.sequence_parallel,
            "optimizer_parallel": dataclasses.asdict(st.optimizer), "fit_margin_gib": FIT_MARGIN_GIB,
            "schedule": "1F1B (stage k holds p - k micro-batches)",
            "communication": "not overlapped with compute; placement mp innermost, then cp, then dp, then pp",
            "flops_per_token": flops_per_token(cfg, st.seq_len),
        },
        "constraints": {k: v for k, v in st.constraints.items() if v is not None},
        "strategies": strategies, "best": best, "skipped": skipped,
    }
    result["why"] = None if best else _why_nothing(result, cfg, st.memory_gib)
    return result


def _why_nothing(result: dict, cfg: ModelConfig, mem: float) -> str:
    if not result["strategies"]:
        reasons = "; ".join(f"{k} ({n})" for k, n in result["skipped"].items()) or "no candidate"
        return f"no valid strategy matches: {reasons}"
    smallest = min(result["strategies"], key=lambda r: r.memory_gib["total"])
    states = result["assumptions"]["model_states_gib_unsharded"]
    usable = mem - result["assumptions"]["overhead_gib"]
    need = max(2, math.ceil(states / usable)) if usable > 0 else None
    hint = (f"; the unsharded model states alone are {states:.1f} GiB "
            f"({result['assumptions']['bytes_per_param']['total']} bytes x {num_params(cfg):,} parameters), so "
            f"plan for at least {need} devices of {mem:g} GiB and shard them (mp, pp, optimizer_shard)"
            if need else "")
    return (f"nothing fits in {mem:g} GiB: the smallest strategy (dp={smallest.dp} mp={smallest.mp} "
            f"pp={smallest.pp}, micro_batch {smallest.micro_batch}, recompute {smallest.recompute}) needs "
            f"{smallest.memory_gib['total']:.1f} GiB{hint}")


def _splits(devices: int, constraints: dict):
    """(dp, mp, pp, cp) with dp x mp x pp x cp = devices, each with the context-parallel algorithms to try
    ((cp_algo, ulysses_degree): the one mindformers default without cp)."""
    for cp in cp_terms.CP_DEGREES if constraints.get("cp_search") else [constraints.get("cp") or 1]:
        if devices % cp:
            continue
        algos = [constraints.get("cp_algo")] if constraints.get("cp_algo") else cp_terms.SEARCHED_ALGOS
        options = [("colossalai_cp", 1)] if cp == 1 else [
            (a, constraints.get("ulysses_degree") or 1 if a == "hybrid_cp" else 1) for a in algos]
        for mp in _divisors(devices // cp):
            for pp in _divisors(devices // cp // mp):
                for option in options:
                    yield (devices // cp // mp // pp, mp, pp, cp), option


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _invalid_split(cfg: ModelConfig, global_batch: int, dp: int, mp: int, pp: int) -> str | None:
    if global_batch % dp:
        return "global batch not divisible by dp"
    if cfg.num_heads % mp or cfg.kv_heads % mp:
        return "heads not divisible by mp"
    if cfg.ffn_size % mp or cfg.vocab_size % mp:
        return "ffn or vocab size not divisible by mp"
    if pp > cfg.num_layers:
        return "more pipeline stages than layers"
    return None


def _check_constraints(constraints: dict | None) -> dict:
    """The constraints validated; cp "search" (or an algorithm pinned without a degree) becomes cp_search: True."""
    constraints = dict(constraints or {})
    search = constraints.get("cp") == "search"
    if search:
        constraints["cp"] = None
    unknown = set(constraints) - set(Layout.KEYS)
    if unknown:
        raise LabkitError(f"unknown constraint(s) {', '.join(sorted(unknown))}", f"use {', '.join(Layout.KEYS)}")
    if constraints.get("cp") == 1:  # the algorithm does not matter without cp (mindformers ignores it, warning)
        constraints.pop("cp_algo", None), constraints.pop("ulysses_degree", None)
    pinned = {k: constraints[k] for k in Layout.CP_DEFAULTS if constraints.get(k) is not None}
    Layout(**{**Layout.CP_DEFAULTS, **pinned}).check_context("constraint")
    rc = constraints.get("recompute")
    if rc is not None:
        rc = Layout(recompute=Recompute.parse(rc, "constraint recompute")).row()["recompute"]
        if rc not in RECOMPUTE:
            raise LabkitError(f"constraint recompute='{rc}' names some layers only",
                              f"use one of {', '.join(RECOMPUTE)}")
        constraints["recompute"] = rc
    if search or (constraints.get("cp") is None and constraints.get("cp_algo") is not None):
        constraints["cp_search"] = True
    return constraints


def _rounded(d: dict, nd: int = 3) -> dict:
    return {k: round(v, nd) if isinstance(v, float) else v for k, v in d.items()}


# ------------------------------------------------------------------------------------------------ outputs


def format_table(result: dict, top: int = 15) -> str:
    """The ranked strategies as a text table (fitting ones first)."""
    head = (f"{'dp':>3} {'mp':>3} {'pp':>3} {'cp':>3} {'mb':>3} {'acc':>4} {'recompute':>9} {'zero':>4} "
            f"{'GiB':>7} {'states':>7} {'acts':>6} {'step s':>8} {'tok/s/dev':>9} {'MFU':>5}  fits")
    lines = [head, "-" * len(head)]
    for r in result["strategies"][:top]:
        m = r.memory_gib
        states = states_gib(m) + m["copies"]
        lines.append(f"{r.dp:>3} {r.mp:>3} {r.pp:>3} {cp_text(r.layout):>3} {r.micro_batch:>3} {r.accum:>4} "
                     f"{r.recompute:>9} {'on' if r.optimizer_shard else '-':>4} {m['total']:>7.1f} "
                     f"{states:>7.1f} {m['activations']:>6.1f} {r.step_time_s:>8.2f} "
                     f"{r.tokens_per_s_per_device:>9.0f} {r.mfu:>5.0%}  {'yes' if r.fits else 'no'}")
    more = len(result["strategies"]) - top
    if more > 0:
        lines.append(f"... {more} more (--top N or --json for all)")
    return "\n".join(lines)


def cp_text(layout: Layout) -> str:
    """The context parallelism of a layout in a table cell: 1, or cp with r (ring: colossalai_cp), u (ulysses_cp)
    or h (hybrid_cp)."""
    return "1" if layout.cp == 1 else f"{layout.cp}{layout.cp_algo[0] if layout.cp_algo != 'colossalai_cp' else 'r'}"


def plot_memory(result: dict, rows: list[Strategy] | None = None, ax=None, limit: int = 12):
    """Stacked bars of the per-device memory parts for some strategies, with the device memory as a line."""
    import matplotlib.pyplot as plt

    rows = rows if rows is not None else result["strategies"][:limit]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4))
    parts = ["weights", "gradients", "optimizer", "copies", "activations", "overhead"]
    bottom = [0.0] * len(rows)
    x = range(len(rows))
    for part in parts:
        vals = [r.memory_gib[part] for r in rows]
        ax.bar(x, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(result["device_memory_gib"], color="k", ls="--", lw=1, label="device memory")
    ax.set_ylim(0, max(max(bottom, default=0), result["device_memory_gib"]) * 1.3)  # room for the legend
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r.dp}/{r.mp}/{r.pp}{'/' + cp_text(r.layout) if r.cp > 1 else ''}\n"
                        f"{r.recompute[:4]}{' Z' if r.optimizer_shard else ''}"
                        f"\nmb{r.micro_batch}" for r in rows], fontsize=7)
    ax.set_ylabel("GiB per device")
    ax.set_xlabel("dp/mp/pp[/cp], recompute, Z = optimizer shard, micro-batch")
    ax.legend(fontsize=7, ncol=3)
    return ax
