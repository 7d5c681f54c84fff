"""The HF <-> mindformers name mapping, as data: one Rule per parameter family (pattern, shape, layout)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.config import ModelConfig
from labkit.model.shapes import expected_hf_shapes


@dataclass(frozen=True)
class Rule:
    hf: str  # HF name; {i} is the decoder layer
    ms: str  # mindformers parameter name
    shape: str  # HF shape in config terms; mindformers uses the same shape
    layout: str = "same"  # "same" = copied as is; anything else would be a documented, tested transform


MAPPING: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight", "[vocab, hidden]"),
    Rule("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.attention_norm.weight", "[hidden]"),
    Rule("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.attention.wq.weight", "[heads*head_dim, hidden]"),
    Rule("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.attention.wk.weight",
         "[kv_heads*head_dim, hidden]"),
    Rule("model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.attention.wv.weight",
         "[kv_heads*head_dim, hidden]"),
    Rule("model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.attention.wo.weight", "[hidden, heads*head_dim]"),
    Rule("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.ffn_norm.weight", "[hidden]"),
    Rule("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.feed_forward.w1.weight", "[ffn, hidden]"),
    Rule("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.feed_forward.w2.weight", "[hidden, ffn]"),
    Rule("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.feed_forward.w3.weight", "[ffn, hidden]"),
    Rule("model.norm.weight", "model.norm_out.weight", "[hidden]"),
    Rule("lm_head.weight", "lm_head.weight", "[vocab, hidden]; absent when tie_word_embeddings"),
)


# source keys that are not parameters of the target: consumed, checked, recorded, written back by ms2hf
TIED_COPY = "lm_head.weight"  # with tied embeddings some files (pytorch_model.bin) still hold it: must equal the embedding


BUFFER = re.compile(r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq")  # old checkpoints; recomputed from rope_theta


def _rx(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$")


_HF_RX = [(_rx(r.hf), r) for r in MAPPING]


_MS_RX = [(_rx(r.ms), r) for r in MAPPING]


def hf_to_ms(name: str) -> str | None:
    for rx, rule in _HF_RX:
        m = rx.match(name)
        if m:
            return rule.ms.replace("{i}", m.group(1)) if m.groups() else rule.ms
    return None


def ms_to_hf(name: str) -> str | None:
    for rx, rule in _MS_RX:
        m = rx.match(name)
        if m:
            return rule.hf.replace("{i}", m.group(1)) if m.groups() else rule.hf
    return None


def ms_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every mindformers parameter the config implies, with its shape (the same shape as on the HF side)."""
    return {hf_to_ms(k): v for k, v in expected_hf_shapes(cfg).items()}


def mapping_table() -> str:
    rows = [f"{'HF name':52} {'mindformers name':50} {'shape':30} layout"]
    rows += [f"{r.hf:52} {r.ms:50} {r.shape:30} {r.layout}" for r in MAPPING]
    rows += ["", f"{TIED_COPY} with tie_word_embeddings: must equal the embedding; not stored; ms2hf writes it back",
             f"{BUFFER.pattern.replace(chr(92), '')}: buffer, checked against rope_theta, kept in conversion.json",
             "layout 'same': both sides store Linear weights [out, in]; no transpose, no q/k permutation"]
    return "\n".join(rows)
