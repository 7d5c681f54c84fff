"""HF `config.json` <-> labkit ModelConfig: what mindformers' Llama can express, refused by name otherwise."""
from __future__ import annotations

from pathlib import Path
import yaml
from labkit.config import ModelConfig, load, to_dict
from labkit.errors import LabkitError


_HF_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, pad_token_id=None, initializer_range=0.02, hidden_act="silu")


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_config_from_hf(hf_config: dict, name: str | None = None) -> ModelConfig:
    """A ModelConfig from an HF Llama-family `config.json`; refuses, naming the key, what mindformers cannot express."""
    if not isinstance(hf_config, dict):
        raise LabkitError("config.json must hold a JSON object")
    c = {**_HF_DEFAULTS, **hf_config}
    bad: list[str] = []
    mtype, archs = c.get("model_type"), c.get("architectures") or []
    if mtype not in ("llama", "mistral"):
        bad.append(f"model_type={mtype!r}: only Llama-family decoders ('llama', or 'mistral' without a sliding window)")
    if mtype == "mistral" and hf_config.get("sliding_window", 4096) is not None:
        bad.append(f"sliding_window={hf_config.get('sliding_window', 4096)}: mindformers' Llama has no sliding window")
    if any(a not in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs):
        bad.append(f"architectures={archs}: expected ['LlamaForCausalLM']")
    missing = [k for k in _REQUIRED if k not in hf_config]
    if missing:
        raise LabkitError("config.json cannot be converted: " + "; ".join(bad + [f"{', '.join(missing)} missing"]),
                          "give the complete HF config.json of a Llama-family model")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads) or c["hidden_size"] % heads:
        bad.append(f"head_dim={c.get('head_dim')}: mindformers needs head_dim = hidden_size / num_attention_heads "
                   f"= {c['hidden_size'] / heads:g}")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            bad.append(f"{key}=true: mindformers' Llama has no bias there")
    rs = c.get("rope_scaling")
    if rs and (rs.get("rope_type") or rs.get("type")) not in (None, "default"):
        bad.append(f"rope_scaling={rs}: mindformers' Llama applies plain RoPE only (rope_theta)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        bad.append(f"partial_rotary_factor={c['partial_rotary_factor']}: RoPE on all dimensions only")
    if c.get("hidden_act") != "silu":
        bad.append(f"hidden_act={c.get('hidden_act')!r}: mindformers' Llama FFN is SwiGLU (silu)")
    if c.get("attention_dropout", 0.0):
        bad.append(f"attention_dropout={c['attention_dropout']}: mindformers' Llama has no attention dropout")
    if c.get("quantization_config"):
        bad.append("quantization_config: quantized checkpoints are not supported; use a float checkpoint")
    if bad:
        raise LabkitError("config.json has what mindformers' Llama cannot express: " + "; ".join(bad),
                          "use a checkpoint without these features; nothing was written")
    eos = c["eos_token_id"]
    first = lambda x, d: (x[0] if x else d) if isinstance(x, list) else (d if x is None else x)  # noqa: E731
    data = dict(name=name or str(hf_config.get("_name_or_path") or "hf-llama").rstrip("/").split("/")[-1] or "hf-llama",
                vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
                intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=c["tie_word_embeddings"],
                bos_token_id=first(c["bos_token_id"], 1), eos_token_id=first(eos, 2),
                pad_token_id=first(c["pad_token_id"], 0), init_std=c["initializer_range"])
    return load(ModelConfig, data, "config.json")


def hf_config_from_model(cfg: ModelConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """The HF config.json for a ModelConfig. With `base` (the recorded original), only what changed is rewritten,
    so an unchanged model gets its original config.json back key for key."""
    fresh = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=cfg.vocab_size,
                 hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
                 num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                 rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
                 max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                 bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                 initializer_range=cfg.init_std, attention_bias=False, mlp_bias=False, dtype=dtype)
    if base is None:
        return fresh
    out = dict(base)
    was = to_dict(model_config_from_hf(base, name=cfg.name))
    hf_key = dict(num_layers="num_hidden_layers", num_heads="num_attention_heads", num_kv_heads="num_key_value_heads",
                  init_std="initializer_range")
    for k, v in to_dict(cfg).items():
        if k not in ("name", "multiple_of", "ffn_dim_multiplier") and v != was[k]:
            key = hf_key.get(k, k)
            out[key] = fresh[key] if key in fresh else v
    if "head_dim" in out:
        out["head_dim"] = cfg.head_dim
    for key in ("dtype", "torch_dtype"):
        if key in out:
            out[key] = dtype
    return out


def read_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "model.yaml"
    if not path.is_file():
        raise LabkitError(f"{path} not found", "point at a directory written by `labkit convert hf2ms`")
    return load(ModelConfig, yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
