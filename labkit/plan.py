"""The parallel-strategy planner: memory and time per device for every dp x mp x pp split, micro-batch,
accumulation, recomputation and optimizer sharding; the best one as mindformers YAML and an msrun command.

Memory per device (bytes), for the most loaded pipeline stage:
  weights + gradients + optimizer states  (bytes per parameter from the precision; optimizer states divided by dp
                                           when sharded, as ZeRO-1 does; one gradient-sized buffer, which with
                                           accum > 1 is mindformers' `accu_grads` that each micro-step adds into)
  + activations                            (Korthikanti et al. 2022, counted tensor by tensor for a Llama layer,
                                           with the backward tensors MindSpore computes during the forward pass)
  + framework overhead                     (a stated constant per device preset)
Time per step: FLOPs (6 N per token + the attention term, recompute adds its forward) over peak x efficiency,
plus tensor-parallel all-reduces, pipeline sends and the data-parallel gradient all-reduce over the preset's
bandwidths (not overlapped with compute), plus the pipeline bubble (p - 1) / m.
The same code models the CPU (precision fp32, no flash attention): bench/plan_calibration.py checks it there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig
from .devices import GIB, Device, device_preset
from .errors import LabkitError


@dataclass(frozen=True)
class Precision:
    act: int  # bytes per activation element (compute dtype)
    param: int  # bytes per weight
    grad: int  # bytes per gradient (MindSpore gradients take the weight's dtype)


PRECISIONS = {
    "fp32": Precision(act=4, param=4, grad=4),
    # mindformers' Llama-2 recipes: param_init_type float16, compute fp16/bf16, AdamW moments in fp32
    "fp16": Precision(act=2, param=2, grad=2),
    "bf16": Precision(act=2, param=2, grad=2),
}
MOMENT_BYTES = 8  # AdamW m and v in float32 (mindformers.core.optim.AdamW clones them as float32)
MASTER_BYTES = 4  # an fp32 master copy, kept only with master_weights=True (ZeRO's 16 bytes/param convention)
# mindformers CrossEntropyLoss at the peak (end of the forward pass), vocabulary-sized fp32 tensors: the one-hot
# labels, the log-softmax, _NLLLoss.bprop's exp(log-softmax) (see early_backward_elements) and the forward product
# log-softmax * one-hot; the logits themselves are freed once the log-softmax exists. Counted in MindSpore's kernel
# graph (MindSpore 2.9 / mindformers 1.9, bench/plan_calibration.py). It was 5, which offset per-layer tensors the
# count then missed (see early_backward_elements).
LOSS_FP32_COPIES = 4
RECOMPUTE = ("none", "selective", "full")
CONSTRAINT_KEYS = ("dp", "mp", "pp", "micro_batch", "accum", "recompute", "optimizer_shard")
DEFAULT_EFFICIENCY = 0.5  # achievable fraction of peak for the matmuls (Megatron 44-52%, mindformers 7B ~53% MFU)
DEFAULT_GLOBAL_BATCH = 64  # sequences per step: mindformers' Llama-2-7B recipe (dp 8 x batch 1 x accum 8)


# ------------------------------------------------------------------------------------------- memory model


def bytes_per_param(precision: str = "fp16", master_weights: bool = False) -> dict[str, int]:
    """Weights, gradients and optimizer bytes per parameter (before any sharding)."""
    p = _precision(precision)
    opt = MOMENT_BYTES + (MASTER_BYTES if master_weights else 0)
    return {"weights": p.param, "gradients": p.grad, "optimizer": opt, "total": p.param + p.grad + opt}


def stage_params(cfg: ModelConfig, mp: int = 1, pp: int = 1) -> dict[str, dict]:
    """Parameters held by one device of the first and of the last pipeline stage ("only" without a pipeline).

    Layers split as evenly as possible (the first stages take the remainder); the embedding is replicated over
    mp (mindformers' vocab_emb_dp) and sits on the first stage; the output layer is split over mp on the last."""
    h, L = cfg.hidden_size, cfg.num_layers
    kv = cfg.kv_heads * cfg.head_dim
    per_layer = (2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_size) / mp + 2 * h
    embed = cfg.vocab_size * h
    head = cfg.vocab_size * h / mp  # the output layer (tied: a copy of the embedding on the last stage)
    if pp == 1:
        return {"only": {"layers": L, "params": L * per_layer + embed + h + (0 if cfg.tie_word_embeddings else head)}}
    n_first, n_last = math.ceil(L / pp), L // pp  # the first L % pp stages take one layer more
    return {"first": {"layers": n_first, "params": n_first * per_layer + embed},
            "last": {"layers": n_last, "params": n_last * per_layer + head + h}}
    return out


def layer_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, *, mp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none", flash_attention: bool = True,
                      fused_norm: bool = True, fused_silu: bool = True) -> dict[str, float]:
    """Activation elements of one decoder layer for one micro-batch: `stored` (kept for the backward pass) and
    `working` (re-materialised for one layer at a time in the backward pass when recomputing).

    Korthikanti et al. 2022 (Table 2) counted for a Llama layer (RMSNorm, SwiGLU, no dropout) instead of GPT:
      norms: input + output each (+ the normalised tensor before the gain when the norm is not fused)
      attention: Q, K, V (K, V expanded to all heads when mindformers repeats them without flash attention),
                 the context (input of wo), and the softmax output a*s*s per sequence unless flash attention
      SwiGLU: w1 output (SiLU input), SiLU output, w3 output, their product (w2 input): 4 * s * f
    plus, without fused norm / SiLU kernels, the backward tensors MindSpore computes during the forward pass
    (early_backward_elements). Tensor parallel splits everything but the norm tensors, which sequence parallel splits
    as well."""
    s, b, h, f, a = seq_len, micro_batch, cfg.hidden_size, cfg.ffn_size, cfg.num_heads
    sbh = s * b * h
    kv = cfg.kv_heads * cfg.head_dim if flash_attention else h
    early = early_backward_elements(cfg, seq_len, micro_batch, fused_norm=fused_norm, fused_silu=fused_silu)
    norms = 2 * ((2 if fused_norm else 3) * sbh + early["per_norm"])
    split = sbh * 2 + 2 * s * b * kv + 4 * s * b * f + early["ffn"]
    scores = 0.0 if flash_attention else a * s * s * b
    stats = 2 * a * s * b if flash_attention else 0.0  # flash attention keeps softmax max and sum per row
    norms_dev = norms / mp if sequence_parallel else norms
    full = norms_dev + (split + scores + stats) / mp
    if recompute == "none":
        return {"stored": full, "working": 0.0}
    if recompute == "selective":  # recompute the attention core (scores, softmax) in the backward pass
        return {"stored": full - scores / mp, "working": scores / mp}
    if recompute == "full":  # keep only the layer input (and the first norm's early backward tensor, computed from it)
        kept = sbh + early["per_norm"]
        return {"stored": kept / mp if sequence_parallel else kept, "working": full}
    raise LabkitError(f"recompute '{recompute}' is not known", f"use one of {', '.join(RECOMPUTE)}")


def loss_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, *, mp: int = 1, act_bytes: int = 2,
                     fused_norm: bool = True) -> float:
    """Bytes of the final norm, logits and loss at the peak (start of the backward pass), last stage only."""
    sb = seq_len * micro_batch
    logits = sb * cfg.vocab_size / mp
    early = early_backward_elements(cfg, seq_len, micro_batch, fused_norm=fused_norm)["per_norm"]
    norm = ((2 if fused_norm else 3) * sb * cfg.hidden_size + early) * act_bytes
    return norm + logits * (LOSS_FP32_COPIES * 4 + (act_bytes if act_bytes != 4 else 0))


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


def early_backward_elements(cfg: ModelConfig, seq_len: int, micro_batch: int, *, fused_norm: bool = True,
                            fused_silu: bool = True) -> dict[str, float]:
    """Elements of the backward tensors MindSpore computes during the forward pass, for one micro-batch:
    `per_norm` for each unfused RMSNorm, `ffn` for each decoder layer's unfused SiLU (see the block comment)."""
    sb = seq_len * micro_batch
    return {"per_norm": 0.0 if fused_norm else float(sb * cfg.hidden_size),
            "ffn": 0.0 if fused_silu else float(sb * cfg.ffn_size)}


def recompute_mask_elements(seq_len: int, micro_batch: int, recompute: str, flash_attention: bool) -> float:
    """Elements of the additive attention mask (b, 1, s, s) kept for the backward pass: only when recomputed layers
    read it again there (without recomputation it is freed after the last layer's forward). Flash attention takes
    its own compressed mask instead, not counted."""
    if recompute == "none" or flash_attention:
        return 0.0
    return float(micro_batch * seq_len * seq_len)


def adamw_early_bytes(params: float) -> float:
    """Bytes of mindformers AdamW's weight-decay product param_fp32 * (1 - lr * weight_decay), which MindSpore
    computes for every parameter at the start of the step and keeps until the update (float32 whatever the weights'
    dtype). The CPU memory pool holds it through the forward pass (see the block comment)."""
    return 4.0 * params


def memory_breakdown(cfg: ModelConfig, *, seq_len: int, dp: int = 1, mp: int = 1, pp: int = 1,
                     micro_batch: int = 1, accum: int = 1, recompute: str = "none", optimizer_shard: bool = False,
                     precision: str = "fp16", master_weights: bool = False, flash_attention: bool = True,
                     sequence_parallel: bool = False, fused_norm: bool = True, fused_silu: bool = True,
                     overhead_gib: float = 0.0) -> dict[str, float]:
    """Peak memory of the most loaded device, in GiB, by part (see the module docstring)."""
    prec = _precision(precision)
    bpp = bytes_per_param(precision, master_weights)
    stages = stage_params(cfg, mp, pp)
    worst = None
    for name, st in stages.items():
        params = st["params"]
        weights = params * bpp["weights"]
        grads = params * bpp["gradients"]
        opt = params * bpp["optimizer"] / (dp if optimizer_shard else 1)
        layer = layer_activations(cfg, seq_len, micro_batch, mp=mp, sequence_parallel=sequence_parallel,
                                  recompute=recompute, flash_attention=flash_attention, fused_norm=fused_norm,
                                  fused_silu=fused_silu)
        in_flight = min(pp if name == "first" else 1, accum)  # 1F1B: stage k holds p - k micro-batches
        loss = loss_activations(cfg, seq_len, micro_batch, mp=mp, act_bytes=prec.act,
                                fused_norm=fused_norm) if name != "first" else 0.0
        mask = in_flight * recompute_mask_elements(seq_len, micro_batch, recompute, flash_attention) * prec.act
        acts = in_flight * st["layers"] * layer["stored"] * prec.act + mask + max(loss, layer["working"] * prec.act)
        parts = {"weights": weights, "gradients": grads, "optimizer": opt, "activations": acts}
        total = sum(parts.values())
        if worst is None or total > worst[1]:
            worst = ({**{k: v / GIB for k, v in parts.items()}, "stage": name, "params": params}, total)
    out = worst[0]
    out["overhead"] = overhead_gib
    out["total"] = worst[1] / GIB + overhead_gib
    return out


# --------------------------------------------------------------------------------------------- time model


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> dict[str, float]:
    """Training FLOPs per token. `model` is what MFU counts (6 N over the matmul weights, i.e. without the
    embedding lookup, plus PaLM's attention term 12 L H Q T, no causal halving); `hardware` adds recomputation."""
    counts = cfg.param_counts()
    n = counts["layers"] + cfg.vocab_size * cfg.hidden_size  # the output layer is a matmul; the lookup is not
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len  # QK^T and AV, forward, per token
    model = 6 * n + 3 * attn_fwd
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * counts["layers"] + attn_fwd}.get(recompute)
    if extra is None:
        raise LabkitError(f"recompute '{recompute}' is not known", f"use one of {', '.join(RECOMPUTE)}")
    return {"model": float(model), "hardware": float(model + extra)}


def step_time(cfg: ModelConfig, dev: Device, *, seq_len: int, global_batch: int, dp: int, mp: int, pp: int,
              micro_batch: int, accum: int, recompute: str, optimizer_shard: bool, precision: str,
              peak_tflops: float, efficiency: float, nodes: int, sequence_parallel: bool = False) -> dict:
    """Seconds per optimizer step, by part, and the throughput it implies."""
    prec = _precision(precision)
    devices = dp * mp * pp
    per_node = max(1, devices // nodes)
    tokens = global_batch * seq_len
    fpt = flops_per_token(cfg, seq_len, recompute)
    peak = peak_tflops * 1e12
    compute = tokens * fpt["hardware"] / devices / (peak * efficiency)
    bubble = compute * (pp - 1) / accum
    layers = math.ceil(cfg.num_layers / pp)
    act_msg = micro_batch * seq_len * cfg.hidden_size * prec.act  # one activation tensor of one micro-batch
    bw = {True: dev.intra_node_gbps * 1e9, False: dev.inter_node_gbps * 1e9}
    tp = 0.0
    if mp > 1:  # 2 all-reduces forward, 2 backward per layer (Megatron); full recompute repeats the forward 2
        n_ar = 6 if recompute == "full" else 4
        tp = n_ar * 2 * (mp - 1) / mp * act_msg * layers * accum / bw[mp <= per_node]
    pp_t = 0.0
    if pp > 1:  # each micro-batch: activations forward, their gradients backward, across one stage boundary
        pp_t = 2 * accum * act_msg / (mp if sequence_parallel else 1) / bw[devices <= per_node]
    dp_t = 0.0
    if dp > 1:  # ring all-reduce of the gradients (sharded: reduce-scatter + all-gather, the same volume)
        params = max(st["params"] for st in stage_params(cfg, mp, pp).values())
        dp_t = 2 * (dp - 1) / dp * params * prec.grad / bw[dp * mp <= per_node]
    total = compute + bubble + tp + pp_t + dp_t
    return {
        "step_time_s": total,
        "time_s": {"compute": compute, "bubble": bubble, "tp_comm": tp, "pp_comm": pp_t, "dp_comm": dp_t},
        "tokens_per_s": tokens / total,
        "tokens_per_s_per_device": tokens / total / devices,
        "mfu": tokens * fpt["model"] / total / devices / peak,
    }


# ------------------------------------------------------------------------------------------------- search


def plan(model_cfg: ModelConfig, devices: int, device_memory_gib: float, *, device: str | Device = "atlas_800t_a2",
         seq_len: int = 4096, global_batch: int | None = None, precision: str = "fp16", nodes: int | None = None,
         peak_tflops: float | None = None, efficiency: float = DEFAULT_EFFICIENCY, flash_attention: bool = True,
         constraints: dict | None = None, master_weights: bool = False, sequence_parallel: bool = False,
         overhead_gib: float | None = None) -> dict:
    """Every strategy for `devices` devices of `device_memory_gib` GiB, ranked by predicted throughput.

    constraints: pin any of dp, mp, pp, micro_batch, accum, recompute, optimizer_shard (None = search it).
    nodes: servers the devices sit in (None = as many as the preset's devices_per_node needs)."""
    dev = device if isinstance(device, Device) else device_preset(device, measure=peak_tflops is None)
    _precision(precision)
    if devices < 1 or device_memory_gib <= 0:
        raise LabkitError(f"devices ({devices}) and device memory ({device_memory_gib} GiB) must be positive")
    global_batch = global_batch or DEFAULT_GLOBAL_BATCH
    if global_batch < 1 or seq_len < 1:
        raise LabkitError(f"global_batch ({global_batch}) and seq_len ({seq_len}) must be positive")
    nodes = nodes or max(1, math.ceil(devices / dev.devices_per_node))
    if devices % nodes:
        raise LabkitError(f"{devices} devices do not split evenly over {nodes} nodes", "choose nodes dividing devices")
    peak = float(peak_tflops) if peak_tflops else dev.peak(precision)
    if not 0 < efficiency <= 1:
        raise LabkitError(f"efficiency {efficiency} must be in (0, 1]", "e.g. 0.5 for half of peak")
    overhead = dev.overhead_gib if overhead_gib is None else overhead_gib
    fused_norm = dev.name.startswith("atlas")  # mindformers' fused RMSNorm kernel is Ascend-only (labkit.model)
    fused_silu = dev.name != "cpu"  # MindSpore 2.9 has no CPU SiLU kernel: its expander writes x * Sigmoid(x)
    constraints = _check_constraints(constraints)

    strategies, skipped = [], {}
    for dp, mp, pp in _splits(devices):
        why = _invalid_split(model_cfg, global_batch, dp, mp, pp)
        for mb in _divisors(global_batch // dp) if global_batch % dp == 0 else [None]:
            accum = global_batch // dp // mb if mb else None
            for rc in RECOMPUTE:
                for osh in (False, True) if dp > 1 else (False,):
                    cand = {"dp": dp, "mp": mp, "pp": pp, "micro_batch": mb, "accum": accum, "recompute": rc,
                            "optimizer_shard": osh}
                    if any(constraints.get(k) is not None and cand[k] != constraints[k] for k in CONSTRAINT_KEYS):
                        continue
                    reason = why or (f"pipeline needs micro-batches >= stages (accum {accum} < pp {pp})"
                                     if pp > 1 and accum < pp else None)
                    if reason:
                        skipped[reason] = skipped.get(reason, 0) + 1
                        continue
                    mem = memory_breakdown(model_cfg, seq_len=seq_len, precision=precision,
                                           master_weights=master_weights, flash_attention=flash_attention,
                                           sequence_parallel=sequence_parallel and mp > 1, fused_norm=fused_norm,
                                           fused_silu=fused_silu, overhead_gib=overhead, **cand)
                    t = step_time(model_cfg, dev, seq_len=seq_len, global_batch=global_batch, precision=precision,
                                  peak_tflops=peak, efficiency=efficiency, nodes=nodes,
                                  sequence_parallel=sequence_parallel and mp > 1, **cand)
                    fits = mem["total"] <= device_memory_gib
                    parts = {k: v for k, v in mem.items() if k not in ("stage", "params")}
                    row = {**cand, "memory_gib": _rounded(parts), "stage": mem["stage"],
                           "params_per_device": int(mem["params"]), "step_time_s": round(t["step_time_s"], 4),
                           "time_s": _rounded(t["time_s"], 4),
                           "tokens_per_s": round(t["tokens_per_s"], 1),
                           "tokens_per_s_per_device": round(t["tokens_per_s_per_device"], 1),
                           "mfu": round(t["mfu"], 4), "fits": fits}
                    if not fits:
                        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
                        row["why_not"] = (f"needs {mem['total']:.1f} GiB > {device_memory_gib:g} GiB: model states "
                                          f"{states:.1f} + activations {mem['activations']:.1f} + overhead "
                                          f"{overhead:.1f}")
                    strategies.append(row)
    strategies.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"], r["memory_gib"]["total"]))
    best = next((r for r in strategies if r["fits"]), None)
    bpp = bytes_per_param(precision, master_weights)
    result = {
        "model": model_cfg.name, "params": model_cfg.num_params, "param_counts": model_cfg.param_counts(),
        "devices": devices, "nodes": nodes, "device": dev.name, "device_memory_gib": device_memory_gib,
        "seq_len": seq_len, "global_batch": global_batch, "tokens_per_step": global_batch * seq_len,
        "precision": precision, "peak_tflops": peak, "efficiency": efficiency, "flash_attention": flash_attention,
        "assumptions": {
            "bytes_per_param": bpp, "model_states_gib_unsharded": round(model_cfg.num_params * bpp["total"] / GIB, 2),
            "overhead_gib": overhead, "fused_norm": fused_norm, "fused_silu": fused_silu,
            "sequence_parallel": sequence_parallel, "master_weights": master_weights,
            "schedule": "1F1B (stage k holds p - k micro-batches)",
            "communication": "not overlapped with compute; placement mp innermost, then dp, then pp",
            "flops_per_token": flops_per_token(model_cfg, seq_len),
        },
        "constraints": {k: v for k, v in constraints.items() if v is not None},
        "strategies": strategies, "best": best, "skipped": skipped,
    }
    result["why"] = None if best else _why_nothing(result, model_cfg, device_memory_gib)
    return result


def _why_nothing(result: dict, cfg: ModelConfig, mem: float) -> str:
    if not result["strategies"]:
        reasons = "; ".join(f"{k} ({n})" for k, n in result["skipped"].items()) or "no candidate"
        return f"no valid strategy matches: {reasons}"
    smallest = min(result["strategies"], key=lambda r: r["memory_gib"]["total"])
    states = result["assumptions"]["model_states_gib_unsharded"]
    usable = mem - result["assumptions"]["overhead_gib"]
    need = max(2, math.ceil(states / usable)) if usable > 0 else None
    hint = (f"; the unsharded model states alone are {states:.1f} GiB "
            f"({result['assumptions']['bytes_per_param']['total']} bytes x {cfg.num_params:,} parameters), so "
            f"plan for at least {need} devices of {mem:g} GiB and shard them (mp, pp, optimizer_shard)"
            if need else "")
    return (f"nothing fits in {mem:g} GiB: the smallest strategy (dp={smallest['dp']} mp={smallest['mp']} "
            f"pp={smallest['pp']}, micro_batch {smallest['micro_batch']}, recompute {smallest['recompute']}) needs "
            f"{smallest['memory_gib']['total']:.1f} GiB{hint}")


def _splits(devices: int):
    for mp in _divisors(devices):
        for pp in _divisors(devices // mp):
            yield devices // mp // pp, mp, pp


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
    constraints = dict(constraints or {})
    unknown = set(constraints) - set(CONSTRAINT_KEYS)
    if unknown:
        raise LabkitError(f"unknown constraint(s) {', '.join(sorted(unknown))}", f"use {', '.join(CONSTRAINT_KEYS)}")
    rc = constraints.get("recompute")
    if rc is not None and rc not in RECOMPUTE:
        raise LabkitError(f"constraint recompute='{rc}' is not known", f"use one of {', '.join(RECOMPUTE)}")
    return constraints


def _precision(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise LabkitError(f"precision '{precision}' is not known", f"use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def _rounded(d: dict, nd: int = 3) -> dict:
    return {k: round(v, nd) if isinstance(v, float) else v for k, v in d.items()}


# ------------------------------------------------------------------------------------------------ outputs


PARALLEL_MODES = {"data_parallel": 0, "semi_auto_parallel": 1, "auto_parallel": 2}


def mindformers_parallel_yaml(strategy: dict, *, parallel_mode: str = "semi_auto_parallel",
                              search_mode: str = "sharding_propagation", sequence_parallel: bool = False) -> str:
    """The `parallel`, `parallel_config`, `recompute_config` and `runner_config` blocks of a mindformers run YAML
    for a strategy (keys as in mindformers r1.5.0 configs/llama2/pretrain_llama2_7b.yaml)."""
    if parallel_mode not in PARALLEL_MODES:
        raise LabkitError(f"parallel_mode '{parallel_mode}' is not known", f"use {', '.join(PARALLEL_MODES)}")
    if search_mode not in ("sharding_propagation", "recursive_programming"):
        raise LabkitError(f"search_mode '{search_mode}' is not known",
                          "use sharding_propagation or recursive_programming")
    s = {k: strategy[k] for k in CONSTRAINT_KEYS}
    pipeline = s["pp"] > 1
    micro_batch_num = s["accum"] if pipeline else 1
    accum_steps = 1 if pipeline else s["accum"]
    b = lambda v: "True" if v else "False"  # noqa: E731 - mindformers YAML spells booleans this way
    return f"""\
# planned: dp={s['dp']} mp={s['mp']} pp={s['pp']}, micro_batch {s['micro_batch']} x {s['accum']} micro-steps, \
recompute {s['recompute']}, optimizer_shard {s['optimizer_shard']}
use_parallel: True
parallel:
  parallel_mode: {PARALLEL_MODES[parallel_mode]}  # 0 data, 1 semi-auto, 2 auto parallel
  gradients_mean: False
  enable_alltoall: False
  full_batch: True
  search_mode: "{search_mode}"  # used by auto_parallel only
  enable_parallel_optimizer: {b(s['optimizer_shard'])}  # shard optimizer states (and weights) over dp
  strategy_ckpt_save_file: "./ckpt_strategy.ckpt"
  parallel_optimizer_config:
    gradient_accumulation_shard: False
    parallel_optimizer_threshold: 64
parallel_config:
  data_parallel: {s['dp']}
  model_parallel: {s['mp']}
  pipeline_stage: {s['pp']}
  use_seq_parallel: {b(sequence_parallel)}
  micro_batch_num: {micro_batch_num}  # pipeline micro-batches per step (>= pipeline_stage)
  vocab_emb_dp: True
  gradient_aggregation_group: 4
micro_batch_interleave_num: 1
recompute_config:
  recompute: {b(s['recompute'] == 'full')}
  select_recompute: {b(s['recompute'] == 'selective')}
  parallel_optimizer_comm_recompute: False
  mp_comm_recompute: True
  recompute_slice_activation: True
runner_config:
  batch_size: {s['micro_batch']}  # per device and micro-step
  gradient_accumulation_steps: {accum_steps}
"""


def msrun_command(strategy: dict, nodes: int = 1, *, node_rank: int = 0, master_addr: str = "127.0.0.1",
                  master_port: int = 8118, log_dir: str = "output/msrun_log",
                  script: str = "run_mindformer.py --config pretrain_llama2_7b.yaml --use_parallel True "
                                "--run_mode train") -> str:
    """The msrun line that starts this strategy's workers on one node (run it on every node with its rank)."""
    devices = strategy["dp"] * strategy["mp"] * strategy["pp"]
    if nodes < 1 or devices % nodes:
        raise LabkitError(f"{devices} devices do not split evenly over {nodes} nodes")
    local = devices // nodes
    multi = f" --master_addr={master_addr} --node_rank={node_rank}" if nodes > 1 else ""
    return (f"msrun --worker_num={devices} --local_worker_num={local}{multi} --master_port={master_port} "
            f"--log_dir={log_dir} --join=True {script}")


def format_table(result: dict, top: int = 15) -> str:
    """The ranked strategies as a text table (fitting ones first)."""
    head = (f"{'dp':>3} {'mp':>3} {'pp':>3} {'mb':>3} {'acc':>4} {'recompute':>9} {'zero':>4} "
            f"{'GiB':>7} {'states':>7} {'acts':>6} {'step s':>8} {'tok/s/dev':>9} {'MFU':>5}  fits")
    lines = [head, "-" * len(head)]
    for r in result["strategies"][:top]:
        m = r["memory_gib"]
        states = m["weights"] + m["gradients"] + m["optimizer"]
        lines.append(f"{r['dp']:>3} {r['mp']:>3} {r['pp']:>3} {r['micro_batch']:>3} {r['accum']:>4} "
                     f"{r['recompute']:>9} {'on' if r['optimizer_shard'] else '-':>4} {m['total']:>7.1f} "
                     f"{states:>7.1f} {m['activations']:>6.1f} {r['step_time_s']:>8.2f} "
                     f"{r['tokens_per_s_per_device']:>9.0f} {r['mfu']:>5.0%}  {'yes' if r['fits'] else 'no'}")
    more = len(result["strategies"]) - top
    if more > 0:
        lines.append(f"... {more} more (--top N or --json for all)")
    return "\n".join(lines)


def plot_memory(result: dict, rows: list[dict] | None = None, ax=None, limit: int = 12):
    """Stacked bars of the per-device memory parts for some strategies, with the device memory as a line."""
    import matplotlib.pyplot as plt

    rows = rows if rows is not None else result["strategies"][:limit]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4))
    parts = ["weights", "gradients", "optimizer", "activations", "overhead"]
    bottom = [0.0] * len(rows)
    x = range(len(rows))
    for part in parts:
        vals = [r["memory_gib"][part] for r in rows]
        ax.bar(x, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(result["device_memory_gib"], color="k", ls="--", lw=1, label="device memory")
    ax.set_ylim(0, max(max(bottom, default=0), result["device_memory_gib"]) * 1.3)  # room for the legend
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['dp']}/{r['mp']}/{r['pp']}\n{r['recompute'][:4]}{' Z' if r['optimizer_shard'] else ''}"
                        f"\nmb{r['micro_batch']}" for r in rows], fontsize=7)
    ax.set_ylabel("GiB per device")
    ax.set_xlabel("dp/mp/pp, recompute, Z = optimizer shard, micro-batch")
    ax.legend(fontsize=7, ncol=3)
    return ax


# ---------------------------------------------------------------------------------------------------- CLI


def model_from_config_file(path) -> tuple[ModelConfig, dict]:
    """The model of a labkit run config (its `model:` section: `preset: NAME` plus overrides, or ModelConfig
    fields) and the few other values the planner can use (data.seq_len)."""
    from .config import load, model_preset, read_yaml

    data = read_yaml(path)
    section = data.get("model")
    if not isinstance(section, dict):
        raise LabkitError(f"{path} has no 'model:' section", "add model: {preset: tiny} or the ModelConfig fields")
    spec = dict(section)
    preset = spec.pop("preset", None)
    try:
        cfg = model_preset(preset, **spec) if preset else load(ModelConfig, spec, "model")
    except LabkitError as e:
        raise LabkitError(f"{path}: {e.what}", e.fix) from None
    extra = {}
    seq = (data.get("data") or {}).get("seq_len") if isinstance(data.get("data"), dict) else None
    if seq:
        extra["seq_len"] = int(seq)
    return cfg, extra


def add_cli(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model preset (tiny, llama_100m, llama2_7b)")
    src.add_argument("--config", help="a labkit run config YAML with a model: section")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (cards)")
    parser.add_argument("--device-memory", type=float, required=True, help="memory per device, GiB")
    parser.add_argument("--device", default="atlas_800t_a2", help="device preset for peak FLOP/s and bandwidth "
                        "(atlas_800t_a2, a100_80g, h100_80g, h200_141g, cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096, or the "
                        "config's data.seq_len)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--precision", default=None, choices=list(PRECISIONS),
                        help="weights/compute precision (default fp16; fp32 with --device cpu)")
    parser.add_argument("--nodes", type=int, default=None, help="servers (default: from the preset's devices per node)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the preset's peak (TFLOP/s)")
    parser.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, help="achievable fraction of peak")
    parser.add_argument("--no-flash-attention", action="store_true", help="model attention without flash attention")
    parser.add_argument("--top", type=int, default=15, help="rows of the table (human output)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    from .cli import emit
    from .config import model_preset

    if args.preset:
        cfg, extra = model_preset(args.preset), {}
    else:
        cfg, extra = model_from_config_file(args.config)
    seq = args.seq_len or extra.get("seq_len") or 4096
    precision = args.precision or ("fp32" if args.device == "cpu" else "fp16")
    result = plan(cfg, args.devices, args.device_memory, device=args.device, seq_len=seq,
                  global_batch=args.global_batch, precision=precision, nodes=args.nodes,
                  peak_tflops=args.peak_tflops, efficiency=args.efficiency,
                  flash_attention=not args.no_flash_attention and args.device != "cpu")
    best = result["best"]
    if best:
        result["mindformers_yaml"] = mindformers_parallel_yaml(best)
        result["msrun"] = msrun_command(best, result["nodes"])
    text = [f"{cfg.name}: {result['params']:,} parameters; {args.devices} x {args.device_memory:g} GiB "
            f"({result['device']}, peak {result['peak_tflops']:g} TFLOP/s {precision}, efficiency "
            f"{args.efficiency:g}); seq {seq}, global batch {result['global_batch']}",
            f"bytes per parameter: {result['assumptions']['bytes_per_param']}",
            "", format_table(result, args.top), ""]
    if best:
        text += ["best:", result["mindformers_yaml"], result["msrun"]]
    else:
        text.append(f"no strategy fits: {result['why']}")
    emit(args, {"ok": True, **result}, "\n".join(text))
    return 0
