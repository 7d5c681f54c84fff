"""Do these artefacts belong together? Weights against a model config, a tokenizer against a model, read from the
files' headers (no framework, nothing built) and refused with one line naming both sides and the fix.

labkit.training.run_dir applies them to runs (train, launch, generate, notebook 07); conversion and parity call them
directly (the weights layer cannot import the training layer)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.io import read_json_object
from labkit.weights.formats import ckpt_index, model_entries
from labkit.weights.hf_config import read_model_config
from labkit.weights.name_map import hf_to_ms, ms_shapes


STRUCTURE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_heads", "ffn_size", "tie_word_embeddings")
CONFIG_KEY = {"kv_heads": "num_kv_heads", "ffn_size": "intermediate_size"}  # ModelConfig properties -> config keys


def _key(key: str) -> str:
    return "model." + CONFIG_KEY.get(key, key)


def _shown(e) -> str:
    return f"{e.name} {list(e.shape)}"


def inferred_model(weights: dict) -> dict[str, tuple]:
    """What a checkpoint's tensors say about its model: {ModelConfig key: (value, the tensor that says so)}."""
    out = {}
    embed = weights.get(hf_to_ms("model.embed_tokens.weight"))
    if embed is not None and len(embed.shape) == 2:
        out["vocab_size"] = (embed.shape[0], _shown(embed))
        out["hidden_size"] = (embed.shape[1], _shown(embed))
    layers = sorted({int(m.group(1)) for n in weights if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    if layers:
        out["num_layers"] = (layers[-1] + 1, f"model.layers.{layers[-1]}.*")
    w1 = weights.get("model.layers.0.feed_forward.w1.weight")
    if w1 is not None:
        out["ffn_size"] = (w1.shape[0], _shown(w1))
    head = weights.get("lm_head.weight")
    out["tie_word_embeddings"] = (head is None, _shown(head) if head is not None else "no lm_head.weight")
    return out


def model_mismatch(index: dict, cfg: ModelConfig, *, source: ModelConfig | None = None, keys=STRUCTURE,
                   against: str = "the config") -> str | None:
    """How the model weights in `index` (a `ckpt_index`) differ from the model `cfg` describes, or None. `source`
    is the model config recorded with the weights (it also names what shapes cannot show, e.g. num_heads); without
    it the tensors' shapes say what they can. One clause: "has model.hidden_size 256 (<tensor> [4096, 256]), the
    config asks for 128", or the tensors that differ."""
    weights, want = model_entries(index), ms_shapes(cfg)
    wrong = [weights[n] for n in want if n in weights and tuple(weights[n].shape) != tuple(want[n])]
    missing = [n for n in want if n not in weights]
    extra = [weights[n] for n in weights if n not in want]
    first = (_shown(wrong[0]) if wrong else f"no {missing[0]}" if missing else _shown(extra[0]) if extra else None)
    said = ({k: (getattr(source, k), first) for k in keys} if source is not None else inferred_model(weights))
    diffs = [(k, v, why) for k, (v, why) in said.items() if k in keys and v != getattr(cfg, k)]
    if diffs:
        (k, v, why), rest = diffs[0], diffs[1:]
        return (f"has {_key(k)} {v}" + (f" ({why})" if why else "") + f", {against} asks for {getattr(cfg, k)}"
                + "".join(f"; also {_key(k2)} {v2} vs {getattr(cfg, k2)}" for k2, v2, _ in rest))
    if wrong or missing or extra:
        parts = ([f"{_shown(e)} where {against} implies {list(want[e.name])}" for e in wrong]
                 + [f"no {n}" for n in missing]
                 + [f"{_shown(e)}, which {against}'s model does not have" for e in extra])
        return "holds " + "; ".join(parts[:3]) + (f" ({len(parts)} differences)" if len(parts) > 3 else "")
    return None


@dataclass(frozen=True)
class ParamDtype:
    """The dtype the model's parameters take (MindSpore's load_param_into_net does not convert), what decides it
    (`note`, e.g. " (train.amp_level O0)") and what to do about weights stored otherwise (None: the shape fix)."""

    dtype: str
    note: str = ""
    fix: str | None = None


def check_weights(label: str, index: dict, cfg: ModelConfig, fix: str, *, source: ModelConfig | None = None,
                  keys=STRUCTURE, against: str = "the config", dtype: ParamDtype | None = None) -> None:
    """Refuse weights that do not fit the model `cfg` describes (see `model_mismatch`), or, with `dtype`, that are
    stored in another dtype than the model's parameters."""
    problem = model_mismatch(index, cfg, source=source, keys=keys, against=against)
    if problem:
        raise LabkitError(f"{label} {problem}", fix)
    other = [e for e in model_entries(index).values() if dtype and e.dtype != dtype.dtype]
    if other:
        raise LabkitError(f"{label} stores {other[0].name} as {other[0].dtype}"
                          + (f" ({len(other)} tensors)" if len(other) > 1 else "")
                          + f", the model's parameters are {dtype.dtype}{dtype.note}", dtype.fix or fix)


def tokenizer_span(directory) -> tuple[int, str] | None:
    """(largest token id + 1, the file that says so) of a tokenizer directory, read from its vocabulary files
    without loading the tokenizer; None when the directory holds none. The span, not the count: the embedding
    must have a row for every id (labkit.data.tokenizer.vocab_size measures the same on a loaded tokenizer)."""
    d = Path(directory)
    ids: list[int] = []
    if (d / "tokenizer.json").is_file():
        data, name = read_json_object(d / "tokenizer.json", "the tokenizer"), "tokenizer.json"
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
        ids += [t.get("id", -1) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    elif (d / "vocab.json").is_file():
        name = "vocab.json"
        ids = list(read_json_object(d / name, "the tokenizer's vocabulary").values())
    elif (d / "tokenizer.model").is_file():
        import sentencepiece as spm  # its C++ parser; nothing of protobuf's Python module (see tokenizer_files)

        name = "tokenizer.model"
        try:
            ids = [spm.SentencePieceProcessor(model_proto=(d / name).read_bytes()).get_piece_size() - 1]
        except (RuntimeError, OSError, TypeError):
            return None  # not a SentencePiece model: the tokenizer's own checks name that when it loads
    elif (d / "vocab.txt").is_file():
        name = "vocab.txt"
        ids = [len((d / name).read_text(encoding="utf-8").splitlines()) - 1]
    else:
        return None
    if (d / "added_tokens.json").is_file():
        ids += list(read_json_object(d / "added_tokens.json", "the added tokens").values())
    ids = [i for i in ids if isinstance(i, int)]
    return (max(ids) + 1, name) if ids else None


def check_tokenizer_fits(tokenizer_dir, vocab_size: int, model: str, fix: str) -> int | None:
    """Refuse a tokenizer with ids beyond the model's embedding rows; its id span (None: no vocabulary files)."""
    span = tokenizer_span(tokenizer_dir)
    if span and span[0] > vocab_size:
        raise LabkitError(f"tokenizer {tokenizer_dir} ({span[1]}) has token ids up to {span[0] - 1}, {model} has "
                          f"vocab_size {vocab_size} (embedding rows 0..{vocab_size - 1})", fix)
    return span[0] if span else None


CONVERTED_TOKENIZER_FIX = ("pair the weights with the tokenizer they were trained with, or give the embeddings a "
                           "row per token id with `labkit tokenizer resize-embeddings --vocab-size N`")


def check_converted(directory) -> ModelConfig:
    """The ModelConfig of a converted directory whose model.ckpt holds the model model.yaml describes (every
    parameter's name and shape) and whose tokenizer files, when it has them, fit that vocabulary."""
    d = Path(directory)
    cfg = read_model_config(d)
    ckpt = d / "model.ckpt"
    if not ckpt.is_file():
        raise LabkitError(f"{ckpt} not found", "convert again: the directory is incomplete")
    check_weights(str(ckpt), ckpt_index(ckpt), cfg, "the checkpoint and model.yaml must describe the same model: "
                  "convert again", against=str(d / "model.yaml"))
    check_tokenizer_fits(d, cfg.vocab_size, str(d / "model.yaml"), CONVERTED_TOKENIZER_FIX)
    return cfg
