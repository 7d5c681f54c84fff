"""The one source of the model's shapes and arithmetic: every parameter's HF name and shape, the gradient shapes
(what data parallel all-reduces) and the model FLOPs per token (PaLM's 6N + attention; MFU and the planner use it).
Everything here follows from a ModelConfig alone, without building the model."""
from __future__ import annotations

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.config import RECOMPUTE


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
    counts = cfg.param_counts()
    n = counts["layers"] + cfg.vocab_size * cfg.hidden_size  # the output layer is a matmul; the lookup is not
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len  # QK^T and AV, forward, per token
    model = 6 * n + 3 * attn_fwd
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * counts["layers"] + attn_fwd}.get(recompute)
    if extra is None:
        raise LabkitError(f"recompute '{recompute}' is not known", f"use one of {', '.join(RECOMPUTE)}")
    return {"model": float(model), "hardware": float(model + extra)}


def grad_shapes(model_cfg) -> list[tuple[int, ...]]:
    """Shapes of the Llama's trainable parameters (= its gradients), in mindformers' layout."""
    h, f, v = model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.vocab_size
    kv = model_cfg.kv_heads * model_cfg.head_dim
    shapes = [(v, h)]
    for _ in range(model_cfg.num_layers):
        shapes += [(h,), (h,), (h, h), (kv, h), (kv, h), (h, h), (f, h), (h, f), (f, h)]
    shapes.append((h,))
    if not model_cfg.tie_word_embeddings:
        shapes.append((v, h))
    return shapes
