"""The memory model behind the planner: bytes per device for a layout, tensor by tensor.

Memory per device (bytes), for the most loaded pipeline stage:
  weights + gradients + optimizer states  (bytes per parameter from the precision; optimizer states divided by dp
                                           when sharded, as ZeRO-1 does; one gradient-sized buffer, which with
                                           accum > 1 is mindformers' `accu_grads` that each micro-step adds into)
  + activations                            (Korthikanti et al. 2022, counted tensor by tensor for a Llama layer,
                                           plus the backward tensors MindSpore computes during the forward pass)
  + framework overhead                     (a stated constant per device preset)
bench/plan_calibration.py checks the activation terms against MindSpore's memory pool on CPU."""
from __future__ import annotations

import math
from dataclasses import dataclass
from labkit.config import ModelConfig
from labkit.layout import RECOMPUTE, Layout
from labkit.parallel.devices import GIB
from labkit.errors import LabkitError


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


@dataclass(frozen=True)
class Numerics:
    """How a step computes, as far as its memory and time see it: the precision of weights and activations, an fp32
    master copy of the weights kept by the optimizer, flash attention, and fused RMSNorm and SiLU kernels (the
    planner takes these two from the device: MindSpore 2.9 has neither on CPU)."""

    precision: str = "fp16"  # one of PRECISIONS
    master_weights: bool = False
    flash_attention: bool = True
    fused_norm: bool = True
    fused_silu: bool = True


MOMENT_BYTES = 8  # AdamW m and v in float32 (mindformers.core.optim.AdamW clones them as float32)


MASTER_BYTES = 4  # an fp32 master copy, kept only with master_weights=True (ZeRO's 16 bytes/param convention)


# mindformers CrossEntropyLoss at the peak (end of the forward pass), vocabulary-sized fp32 tensors: the one-hot
# labels, the log-softmax, _NLLLoss.bprop's exp(log-softmax) (see early_backward_elements) and the forward product
# log-softmax * one-hot; the logits themselves are freed once the log-softmax exists. Counted in MindSpore's kernel
# graph (MindSpore 2.9 / mindformers 1.9, bench/plan_calibration.py). It was 5, which offset per-layer tensors the
# count then missed (see early_backward_elements).
LOSS_FP32_COPIES = 4


def bytes_per_param(precision: str = "fp16", master_weights: bool = False) -> dict[str, int]:
    """Weights, gradients and optimizer bytes per parameter (before any sharding)."""
    p = precision_of(precision)
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


def layer_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, *, mp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none",
                      numerics: Numerics = Numerics()) -> dict[str, float]:
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
    flash_attention, fused_norm = numerics.flash_attention, numerics.fused_norm
    kv = cfg.kv_heads * cfg.head_dim if flash_attention else h
    early = early_backward_elements(cfg, seq_len, micro_batch, fused_norm=fused_norm, fused_silu=numerics.fused_silu)
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


def memory_breakdown(cfg: ModelConfig, layout: Layout = Layout(), *, seq_len: int, numerics: Numerics = Numerics(),
                     overhead_gib: float = 0.0) -> dict[str, float]:
    """Peak memory of the most loaded device, in GiB, by part (see the module docstring). With only some layers
    recomputed (`last:K`...), the breakdowns of the planner's modes weighted (Recompute.planner_modes)."""
    modes = layout.recompute.planner_modes(cfg.num_layers)
    if len(modes) > 1:
        each = [(w, _breakdown(cfg, layout, mode, seq_len, numerics)) for mode, w in modes.items()]
        out = {k: v if k in ("stage", "params") else sum(w * b[k] for w, b in each) for k, v in each[0][1].items()}
    else:
        out = _breakdown(cfg, layout, next(iter(modes)), seq_len, numerics)
    total = out.pop("total")
    out["overhead"] = overhead_gib
    out["total"] = total + overhead_gib
    return out


def _breakdown(cfg: ModelConfig, layout: Layout, recompute: str, seq_len: int, n: Numerics) -> dict:
    """memory_breakdown for one of the planner's modes, every layer alike; `total` without the overhead."""
    prec = precision_of(n.precision)
    bpp = bytes_per_param(n.precision, n.master_weights)
    mp, micro_batch = layout.mp, layout.micro_batch
    stages = stage_params(cfg, mp, layout.pp)
    worst = None
    for name, st in stages.items():
        params = st["params"]
        weights = params * bpp["weights"]
        grads = params * bpp["gradients"]
        opt = params * bpp["optimizer"] / (layout.dp if layout.optimizer_shard else 1)
        layer = layer_activations(cfg, seq_len, micro_batch, mp=mp, sequence_parallel=layout.sequence_parallel,
                                  recompute=recompute, numerics=n)
        in_flight = min(layout.pp if name == "first" else 1, layout.accum)  # 1F1B: stage k holds p - k micro-batches
        loss = loss_activations(cfg, seq_len, micro_batch, mp=mp, act_bytes=prec.act,
                                fused_norm=n.fused_norm) if name != "first" else 0.0
        mask = in_flight * recompute_mask_elements(seq_len, micro_batch, recompute, n.flash_attention) * prec.act
        acts = in_flight * st["layers"] * layer["stored"] * prec.act + mask + max(loss, layer["working"] * prec.act)
        parts = {"weights": weights, "gradients": grads, "optimizer": opt, "activations": acts}
        total = sum(parts.values())
        if worst is None or total > worst[1]:
            worst = ({**{k: v / GIB for k, v in parts.items()}, "stage": name, "params": params}, total)
    return {**worst[0], "total": worst[1] / GIB}


def precision_of(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise LabkitError(f"precision '{precision}' is not known", f"use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]
