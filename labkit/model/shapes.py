"""The one source of the model's shapes and arithmetic: every parameter's HF name and shape, the gradient shapes
(what data parallel all-reduces) and the model FLOPs per token (PaLM's 6N + attention; MFU and the planner use it).
Everything here follows from a ModelConfig alone, without building the model."""
from __future__ import annotations

import math

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.layout import RECOMPUTE


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every HF parameter the config implies, in HF's canonical order, with its shape."""
    h, v, f, q, kv = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
                       p + "mlp.up_proj.weight": (f, h)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> dict[str, float]:
    """Training FLOPs per token. `model` is what MFU counts (6 N over the matmul weights, i.e. without the
    embedding lookup, plus PaLM's attention term 12 L H Q T, no causal halving); `hardware` adds recomputation."""
    counts = param_counts(cfg)
    n = counts["layers"] + cfg.vocab_size * cfg.hidden_size  # the output layer is a matmul; the lookup is not
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len  # QK^T and AV, forward, per token
    model = 6 * n + 3 * attn_fwd
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * counts["layers"] + attn_fwd}.get(recompute)
    if extra is None:
        raise LabkitError(f"recompute '{recompute}' is not known", f"use one of {', '.join(RECOMPUTE)}")
    return {"model": float(model), "hardware": float(model + extra)}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by part (what mindformers allocates), summed from `expected_hf_shapes`."""
    sizes = {name: math.prod(shape) for name, shape in expected_hf_shapes(cfg).items()}
    layers = sum(n for name, n in sizes.items() if name.startswith("model.layers."))
    counts = {"embedding": sizes["model.embed_tokens.weight"], "layers": layers,
              "per_layer": layers // cfg.num_layers, "final_norm": sizes["model.norm.weight"],
              "lm_head": sizes.get("lm_head.weight", 0)}
    counts["total"] = sum(sizes.values())
    return counts


def num_params(cfg: ModelConfig) -> int:
    return param_counts(cfg)["total"]


def pipeline_layers(num_layers: int, stages: int, index: int) -> range:
    """The decoder layers of pipeline stage `index` of `stages`: split as evenly as possible, the first
    num_layers % stages stages taking one layer more (the planner's stages and the hand-written pipeline's). With
    more stages than layers the last stages get none (the planner refuses such splits; its layer line, which sizes
    the model with one layer fewer, reaches them)."""
    if not 0 <= index < stages:
        raise LabkitError(f"there is no stage {index} in a pipeline of {stages}", f"use 0 to {stages - 1}")
    base, extra = divmod(num_layers, stages)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def grad_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the Llama's trainable parameters (= its gradients, what data parallel all-reduces)."""
    return list(expected_hf_shapes(cfg).values())
