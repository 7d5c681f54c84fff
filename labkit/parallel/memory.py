"""The memory model behind the planner: bytes per device for a layout, tensor by tensor.

Memory per device (bytes), for the most loaded pipeline stage:
  weights + gradients + optimizer states  (bytes per element of each weight by role, from the state census of
    + the weights' compute-dtype copies    mindformers' own training cell, labkit.parallel.census; sharded as
                                           MindSpore's parallel optimizer shards them: model_states)
  + activations                            (Korthikanti et al. 2022, counted tensor by tensor for a Llama layer,
                                           plus the backward tensors MindSpore computes during the forward pass)
  + framework overhead                     (a stated constant per device preset)
With context parallelism (cp) every activation is counted at sequence s/cp plus what its attention adds
(labkit.parallel.cp_terms); the weights are replicated over cp, the optimizer shards over dp x cp.
bench/plan_calibration.py checks the activation terms against MindSpore's memory pool on CPU."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from labkit.config import AMP_LEVELS, ModelConfig
from labkit.errors import LabkitError
from labkit.layout import RECOMPUTE, Layout
from labkit.model.shapes import pipeline_layers
from labkit.parallel import census
from labkit.parallel.cp_terms import attention_elements, mask_bytes, mask_compression
from labkit.parallel.devices import GIB


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
ONE_STEP, PIPELINE = "MFTrainOneStepCell", "MFPipelineWithLossScaleCell"


@dataclass(frozen=True)
class Numerics:
    """How a step computes, as far as its memory and time see it: the mixed-precision level (labkit.config.AMP_LEVELS:
    the dtypes mindformers' model_config gets, hence the states the census counted for it), flash attention, and
    fused RMSNorm and SiLU kernels (the planner takes these two from the device: MindSpore 2.9 has neither on CPU)."""

    amp_level: str = "fp16"  # a key of labkit.config.AMP_LEVELS
    flash_attention: bool = True
    fused_norm: bool = True
    fused_silu: bool = True

    @property
    def dtypes(self) -> dict:
        if self.amp_level not in AMP_LEVELS:
            raise LabkitError(f"amp_level '{self.amp_level}' is not known", f"use one of {', '.join(AMP_LEVELS)}")
        return AMP_LEVELS[self.amp_level]

    @property
    def precision(self) -> str:
        """The compute precision (fp32, fp16, bf16): the device peak and the activations' bytes."""
        return SHORT[self.dtypes["compute_dtype"]]

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtypes["compute_dtype"]]


def wrapper_of(layout: Layout) -> str:
    """The training cell mindformers' trainer builds for a semi-auto layout (trainer/base_trainer.py,
    BaseTrainer._reset_wrapper and _reset_wrapper_for_pipeline_parallel): MFPipelineWithLossScaleCell with
    gradient accumulation or a pipeline, which adds the accumulation buffer `accu_grads`; else MFTrainOneStepCell."""
    return PIPELINE if layout.accum > 1 or layout.pp > 1 else ONE_STEP


def census_case(numerics: Numerics, wrapper: str) -> dict:
    """The state census (labkit.parallel.census, STATE_FILE) of an amp level with a wrapper: per role (weights,
    moments, accu_grads) and weight kind, the bytes per element of the weight; per kind parallel_optimizer."""
    name = f"{numerics.amp_level}-{wrapper}"
    case = census.load_states()["cases"].get(name)
    if case is None:
        raise LabkitError(f"the state census has no case {name}",
                          "take it again: python -m labkit.launch.census --write")
    return case


@dataclass(frozen=True)
class Weight:
    """One weight tensor a device of a stage holds `count` of: its kind (census.KINDS), full shape, the axis model
    parallelism splits (None: replicated over mp)."""

    kind: str
    shape: tuple
    split: int | None
    count: int
    layer: bool  # part of a decoder layer (recomputation and level3 free its gathered copy layer by layer)

    def elements(self, mp: int) -> float:
        return math.prod(self.shape) / (mp if self.split is not None else 1)


def layer_weights(cfg: ModelConfig) -> list[Weight]:
    """The weights of one decoder layer with the axis mp splits (Megatron's column/row rule, as mindformers'
    Llama shards them): wq, wk, wv and w1, w3 by output rows, wo and w2 by input columns, the norms whole."""
    h, kv, f = cfg.hidden_size, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    return [Weight("matrix", (h, h), 0, 1, True), Weight("matrix", (kv, h), 0, 2, True),
            Weight("matrix", (h, h), 1, 1, True), Weight("matrix", (f, h), 0, 2, True),
            Weight("matrix", (h, f), 1, 1, True), Weight("norm", (h,), None, 2, True)]


def stage_weights(cfg: ModelConfig, pp: int = 1) -> dict[str, dict]:
    """Per pipeline stage the planner sizes ("only", or "first" and "last"; a middle stage holds no more than the
    first): its decoder layers and the weights one of its devices holds (`stage_at`)."""
    if pp == 1:
        return {"only": stage_at(cfg, 1, 0)}
    return {"first": stage_at(cfg, pp, 0), "last": stage_at(cfg, pp, pp - 1)}


def stage_at(cfg: ModelConfig, pp: int, index: int) -> dict:
    """Pipeline stage `index` of `pp`: its decoder layers (shapes.pipeline_layers: as evenly as possible, the first
    stages take the remainder) and the weights one of its devices holds. The embedding is replicated over mp
    (mindformers' vocab_emb_dp) and sits on the first stage; the final norm and the output layer (split over mp)
    on the last; a tied output layer is the embedding itself with one stage, a copy on the last with more."""
    V, h = cfg.vocab_size, cfg.hidden_size
    emb, norm, head = Weight("embedding", (V, h), None, 1, False), Weight("norm", (h,), None, 1, False), \
        Weight("head", (V, h), 0, 1, False)
    n = len(pipeline_layers(cfg.num_layers, pp, index))
    weights = [dataclasses.replace(w, count=w.count * n) for w in layer_weights(cfg)]
    if index == 0:
        weights.append(emb)
    if index == pp - 1:
        weights += [norm] + ([] if cfg.tie_word_embeddings and pp == 1 else [head])
    return {"layers": n, "weights": weights}


def device_params(stage: dict, mp: int) -> float:
    """Parameters one device of a stage (an entry of stage_weights) holds."""
    return sum(w.count * w.elements(mp) for w in stage["weights"])


def stage_params(cfg: ModelConfig, mp: int = 1, pp: int = 1) -> dict[str, dict]:
    """Parameters held by one device of each pipeline stage (see stage_weights)."""
    return {name: {"layers": st["layers"], "params": device_params(st, mp)}
            for name, st in stage_weights(cfg, pp).items()}


def opt_shards(w: Weight, layout: Layout, case: dict, weight_bytes: float) -> int:
    """Devices MindSpore's parallel optimizer spreads one weight over (1: kept whole), by its own rules
    (frontend/parallel/parallel_optimizer/opt_param_mgr.cc OptParamMgrImpl::SplitParam, tensor_layout.cc
    TensorLayout::GenerateOptShardSliceShape): off without optimizer_shard or data parallelism; skipped for a
    Parameter created with parallel_optimizer=False (the census: mindformers 1.9's Llama embedding and norms),
    for one smaller than parallel_optimizer_threshold (full shape x its dtype's bytes, KB), and when the first
    axis, already split by mp there, does not divide by the shard count; only the first axis is sharded.
    The shard group is every device holding the same slice of the weight (tensor_layout.cc,
    TensorLayout::GenerateOptShardSliceShape: the device-matrix axes the weight's tensor map does not use). With
    context parallelism mindformers' matmuls split their input over dp x cp and the weight over mp only
    (llama_transformer.py: wq.shard(((dp * cp, 1), (mp, 1)))), so the group is dp x cp."""
    group = layout.dp * layout.cp
    if not layout.optimizer_shard or group == 1 or case["parallel_optimizer"].get(w.kind) != [True]:
        return 1
    s = layout.optimizer.shard_size(group)
    if math.prod(w.shape) * weight_bytes < layout.optimizer.threshold_kb * 1024:
        return 1
    return s if w.shape[0] % ((layout.mp if w.split == 0 else 1) * s) == 0 else 1


def model_states(cfg: ModelConfig, layout: Layout, numerics: Numerics, stage: dict,
                 recompute: str = "none") -> dict[str, float]:
    """Bytes one device of a stage keeps for the weights, their gradients, the optimizer and the weights' copies in
    the compute dtype, from the state census of the layout's amp level and wrapper (bytes per element of each weight,
    by role and kind) and MindSpore's optimizer-parallel rules (opt_shards, labkit.layout.OptimizerParallel):

      weights    each weight / its shard count (census: role weights)
      optimizer  AdamW's m and v, sharded like their weight (census: role moments; parameter_manager.cc,
                 SetClonedTensorShapeForOptimizer gives clones the weight's sharded shape)
      gradients  with MFPipelineWithLossScaleCell, `accu_grads` (census), sharded only at level2/level3
                 (grad_accumulation_shard || zero3, SetClonedTensorShapeForOptimizer); with MFTrainOneStepCell the
                 step's gradients in the weight's dtype (MindSpore's autodiff), reduce-scattered at level2/level3
      copies     what the forward keeps of each weight for the backward in the compute dtype: a sharded weight's
                 all-gathered copy (gathered after a cast to the compute dtype when pp > 1 or accumulating,
                 step_parallel_utils.cc FindChildCastWithFP32ToFP16; in its own dtype otherwise), an unsharded
                 matrix's cast copy when its dtype is not the compute dtype (mindformers' Linear casts the weight,
                 MatMul's backward reads the cast). Layer by layer (one layer's worth at a time) for recomputed
                 layers with parallel_optimizer_comm_recompute, and at level3 for every sharded weight."""
    case = census_case(numerics, wrapper_of(layout))
    roles, compute = case["roles"], numerics.act_bytes
    opt, mp = layout.optimizer, layout.mp
    out = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "copies": 0.0}
    layer_copy, layers = 0.0, max(1, stage["layers"])
    for w in stage["weights"]:
        wb = roles["weights"][w.kind]["bytes_per_element"]
        s = opt_shards(w, layout, case, wb)
        n = w.count * w.elements(mp)
        out["weights"] += n * wb / s
        out["optimizer"] += n * roles["moments"][w.kind]["bytes_per_element"] / s
        if "accu_grads" in roles:
            out["gradients"] += n * roles["accu_grads"][w.kind]["bytes_per_element"] / (
                s if opt.shards_gradients() else 1)
        else:
            out["gradients"] += n * wb / (s if opt.shards_gradients() else 1)
        if s > 1:
            gathered = compute if (layout.pp > 1 or layout.accum > 1) and wb == 4 else wb
        elif w.kind in ("matrix", "head") and wb != compute:
            gathered = compute
        else:
            continue
        freed = w.layer and (opt.level == "level3" and s > 1 or recompute == "full" and (opt.comm_recompute or s == 1))
        if freed:
            layer_copy += n * gathered / layers  # one layer's worth at a time
        else:
            out["copies"] += n * gathered
    out["copies"] += layer_copy
    return out


def bytes_per_param(amp_level: str = "fp16", wrapper: str = ONE_STEP) -> dict[str, float]:
    """A matrix's bytes per parameter by part, unsharded, from the state census: weights, gradients (the
    accumulation buffer with MFPipelineWithLossScaleCell), optimizer (AdamW's m and v), total."""
    roles = census_case(Numerics(amp_level), wrapper)["roles"]
    w = roles["weights"]["matrix"]["bytes_per_element"]
    g = roles["accu_grads"]["matrix"]["bytes_per_element"] if "accu_grads" in roles else w
    o = roles["moments"]["matrix"]["bytes_per_element"]
    return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}


# mindformers CrossEntropyLoss at the peak (end of the forward pass), vocabulary-sized fp32 tensors: the one-hot
# labels, the log-softmax, _NLLLoss.bprop's exp(log-softmax) (see early_backward_elements) and the forward product
# log-softmax * one-hot; the logits themselves are freed once the log-softmax exists. Counted in MindSpore's kernel
# graph (MindSpore 2.9 / mindformers 1.9, bench/plan_calibration.py). It was 5, which offset per-layer tensors the
# count then missed (see early_backward_elements).
LOSS_FP32_COPIES = 4


def layer_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, *, mp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none",
                      numerics: Numerics = Numerics(), cp: tuple[int, int] = (1, 1)) -> dict[str, float]:
    """Activation elements of one decoder layer for one micro-batch: `stored` (kept for the backward pass) and
    `working` (re-materialised for one layer at a time in the backward pass when recomputing).

    Korthikanti et al. 2022 (Table 2) counted for a Llama layer (RMSNorm, SwiGLU, no dropout) instead of GPT:
      norms: input + output each (+ the normalised tensor before the gain when the norm is not fused)
      attention: Q, K, V (K, V expanded to all heads when mindformers repeats them without flash attention),
                 the context (input of wo), and the softmax output a*s*s per sequence unless flash attention
      SwiGLU: w1 output (SiLU input), SiLU output, w3 output, their product (w2 input): 4 * s * f
    plus, without fused norm / SiLU kernels, the backward tensors MindSpore computes during the forward pass
    (early_backward_elements). Tensor parallel splits everything but the norm tensors, which sequence parallel splits
    as well. Context parallelism (`cp`: devices per sequence and the Ulysses degree among them, labkit.layout.Layout's
    cp and ulysses) counts all of this at sequence seq_len / cp and adds what its attention keeps and passes round
    (labkit.parallel.cp_terms.attention_elements); it needs flash attention."""
    cp, ulysses = cp
    if cp > 1 and not numerics.flash_attention:
        raise LabkitError(f"context parallel (cp {cp}) without flash attention",
                          "mindformers allows cp > 1 only with flash attention (check_rules._check_parallel)")
    extra = attention_elements(cfg, seq_len, micro_batch, mp=mp, cp=cp, ulysses=ulysses, act_bytes=numerics.act_bytes)
    seq_len //= cp
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
    full = norms_dev + (split + scores + stats) / mp + extra["stored"]
    if recompute == "none":
        return {"stored": full, "working": extra["working"]}
    if recompute == "selective":  # recompute the attention core (scores, softmax) in the backward pass
        return {"stored": full - scores / mp, "working": scores / mp + extra["working"]}
    if recompute == "full":  # keep only the layer input (and the first norm's early backward tensor, computed from it)
        kept = sbh + early["per_norm"]
        return {"stored": kept / mp if sequence_parallel else kept, "working": full + extra["working"]}
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


def flash_mask(seq_len: int, micro_batch: int, layout: Layout, numerics: Numerics) -> dict[str, float]:
    """Bytes of mindformers' causal mask with flash attention on one device (cp_terms.mask_bytes), compressed when the
    run YAML asks for it (cp_terms.mask_compression); none without flash attention (recompute_mask_elements)."""
    if not numerics.flash_attention:
        return {"constant": 0.0, "stored": 0.0, "working": 0.0}
    return mask_bytes(seq_len, micro_batch, numerics.act_bytes, ring=layout.ring > 1,
                      compressed=mask_compression(seq_len, True))


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
    mp, micro_batch, act, cp = layout.mp, layout.micro_batch, n.act_bytes, layout.cp
    worst = None
    for name, st in stage_weights(cfg, layout.pp).items():
        states = model_states(cfg, layout, n, st, recompute)
        layer = layer_activations(cfg, seq_len, micro_batch, mp=mp, sequence_parallel=layout.sequence_parallel,
                                  recompute=recompute, numerics=n, cp=(cp, layout.ulysses))
        in_flight = min(layout.pp if name == "first" else 1, layout.accum)  # 1F1B: stage k holds p - k micro-batches
        loss = loss_activations(cfg, seq_len // cp, micro_batch, mp=mp, act_bytes=act,  # the loss over dp x cp
                                fused_norm=n.fused_norm) if name != "first" else 0.0
        mask = in_flight * recompute_mask_elements(seq_len, micro_batch, recompute, n.flash_attention) * act
        fa_mask = flash_mask(seq_len, micro_batch, layout, n)
        mask += fa_mask["constant"] + in_flight * fa_mask["stored"]
        acts = (in_flight * st["layers"] * layer["stored"] * act + mask
                + max(loss, layer["working"] * act, fa_mask["working"]))
        parts = {**states, "activations": acts}
        total = sum(parts.values())
        if worst is None or total > worst[1]:
            worst = ({**{k: v / GIB for k, v in parts.items()}, "stage": name, "params": device_params(st, mp)},
                     total)
    return {**worst[0], "total": worst[1] / GIB}
