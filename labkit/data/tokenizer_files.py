"""What a tokenizer directory holds, and whether an implementation can read it, checked before anything loads.

Three implementations read tokenizer directories here, and each reads different files:
  hf           transformers' fast (Rust) tokenizer: tokenizer.json, or a slow vocabulary it converts on the fly
  hf-slow      transformers' Python tokenizer for the directory's tokenizer_class: its own vocabulary files
               (LlamaTokenizer: tokenizer.model; GPT2Tokenizer: vocab.json + merges.txt; BertTokenizer: vocab.txt)
  mindformers  mindformers' LlamaTokenizer: a SentencePiece tokenizer.model, nothing else
So a GPT-2 style byte-level BPE folder compares fast against slow, a WordPiece folder too (with vocab.txt), while
mindformers can read neither; a Llama folder with tokenizer.json but no tokenizer.model has no slow form at all.
Each refusal says which implementation cannot read which family and why, instead of a traceback from deep inside.
"""
from __future__ import annotations

from pathlib import Path

from labkit.errors import LabkitError
from labkit.io import read_json_object

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def read_json(path: Path) -> dict:
    """A JSON object from `path` ({} when absent); a file that is not JSON is an error naming it."""
    return read_json_object(path) if path.is_file() else {}


def sentencepiece_problem(path: Path) -> str | None:
    """None when `path` loads as a SentencePiece model with pieces, else the reason it does not. Parsed by
    SentencePiece's C++ code: importing the Python protobuf module here would break mindspore's own later import."""
    import sentencepiece as spm

    data = path.read_bytes()
    try:
        n = spm.SentencePieceProcessor(model_proto=data).get_piece_size()
    except (RuntimeError, OSError, TypeError):
        return f"SentencePiece cannot parse it ({len(data)} bytes, starting {data[:24]!r})"
    if n == 0:
        return f"it parses but holds no pieces ({len(data)} bytes): not a SentencePiece model"
    return None


def family(d: Path) -> str:
    """A name for the tokenizer's algorithm, from tokenizer.json (else tokenizer.model, else the class name)."""
    tj = d / "tokenizer.json"
    if tj.is_file():
        model = read_json(tj).get("model") or {}
        kind = model.get("type")
        text = tj.read_text(encoding="utf-8")
        if kind == "BPE" and '"ByteLevel"' in text:
            return "byte-level BPE (GPT-2 style)"
        if kind == "BPE" and model.get("byte_fallback"):
            return "SentencePiece-style BPE (Llama)"
        if kind:
            return {"WordPiece": "WordPiece (BERT style)", "Unigram": "Unigram (SentencePiece style)"}.get(kind, kind)
    if (d / "tokenizer.model").is_file():
        return "SentencePiece"
    return str(read_json(d / "tokenizer_config.json").get("tokenizer_class") or "unknown")


def _content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def special_token_conflicts(d: Path) -> list[str]:
    """Special tokens that tokenizer_config.json and special_tokens_map.json name differently."""
    cfg, smap = read_json(d / "tokenizer_config.json"), read_json(d / "special_tokens_map.json")
    out = []
    for key in SPECIAL_KEYS:
        a, b = _content(cfg.get(key)), _content(smap.get(key))
        if a is not None and b is not None and a != b:
            out.append(f"{key}: tokenizer_config.json says {a!r}, special_tokens_map.json says {b!r}")
    return out


# the vocabulary files of common slow classes (their `vocab_files_names`), so a refusal needs no transformers import
KNOWN_SLOW = {"LlamaTokenizer": ["tokenizer.model"], "CodeLlamaTokenizer": ["tokenizer.model"],
              "GPT2Tokenizer": ["vocab.json", "merges.txt"], "Qwen2Tokenizer": ["vocab.json", "merges.txt"],
              "BertTokenizer": ["vocab.txt"], "T5Tokenizer": ["spiece.model"]}


def slow_files(d: Path) -> tuple[str, list[str]]:
    """(slow class name, its vocabulary files) for the directory's tokenizer_class; ('', []) when unknown."""
    name = str(read_json(d / "tokenizer_config.json").get("tokenizer_class") or "").removesuffix("Fast")
    if name in KNOWN_SLOW:
        return name, list(KNOWN_SLOW[name])
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    cls = tokenizer_class_from_name(name) if name else None
    if cls is None or name == "PreTrainedTokenizer":
        return name, []
    files = [f for k, f in getattr(cls, "vocab_files_names", {}).items() if k != "tokenizer_file"]
    return name, files


def _has_slow_files(d: Path) -> bool:
    files = slow_files(d)[1]
    return bool(files) and all((d / f).is_file() for f in files)


def _check_sentencepiece(d: Path, impl: str) -> None:
    problem = sentencepiece_problem(d / "tokenizer.model")
    if problem:
        raise LabkitError(f"{d / 'tokenizer.model'} is not a SentencePiece model: {problem}; {impl} reads it",
                          "replace tokenizer.model with the file shipped with the weights (or delete it and compare "
                          "with --*-impl hf, which reads tokenizer.json)")


def check_loadable(d: Path, impl: str) -> None:
    """Raise a LabkitError saying why `impl` cannot read directory `d`; return when it can (as far as files go)."""
    conflicts = special_token_conflicts(d)
    if conflicts:
        raise LabkitError(f"{d}: special tokens disagree between files ({'; '.join(conflicts)})",
                          "make tokenizer_config.json and special_tokens_map.json name the same tokens (the ones "
                          "the model was trained with)")
    fam = family(d)
    has_sp = (d / "tokenizer.model").is_file()
    if impl == "mindformers":
        if not has_sp:
            raise LabkitError(f"mindformers cannot read {d}: it is a {fam} tokenizer without tokenizer.model, and "
                              "mindformers' LlamaTokenizer reads only SentencePiece models",
                              "compare this family with --*-impl hf" + (" and hf-slow (transformers reads it)"
                                                                         if _has_slow_files(d) else ""))
        _check_sentencepiece(d, impl)
    elif impl == "hf-slow":
        name, files = slow_files(d)
        missing = [f for f in files if not (d / f).is_file()]
        if not files:
            raise LabkitError(f"transformers has no slow tokenizer for {d} (tokenizer_class {name or 'missing'}, "
                              f"a {fam} tokenizer)", "compare with --*-impl hf, or set tokenizer_class in "
                              "tokenizer_config.json to the slow class the model was released with")
        if missing:
            raise LabkitError(f"{name} (hf-slow) reads {', '.join(files)}; {d} has no {', '.join(missing)} (a {fam} "
                              "tokenizer; a slow vocabulary cannot be rebuilt from tokenizer.json)",
                              f"copy {', '.join(missing)} from the model's original files, or compare with "
                              "--*-impl hf")
        if "tokenizer.model" in files:
            _check_sentencepiece(d, impl)
    elif not (d / "tokenizer.json").is_file():
        if not has_sp and not slow_files(d)[1]:
            raise LabkitError(f"{d} has neither tokenizer.json nor tokenizer.model",
                              "point at a tokenizer directory (e.g. data/tokenizer)")
        if has_sp:
            _check_sentencepiece(d, impl)
