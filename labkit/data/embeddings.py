"""Vocabulary growth: give a converted checkpoint more (or fewer) embedding rows to match a grown tokenizer.

New rows are the mean of the existing rows (of the embedding and of lm_head respectively): a new token starts as an
"average" token, so the model's outputs on existing text do not change and its probability starts near the typical
one. (Zero rows would give the new token logit 0, often far above typical logits; random rows add noise.)
Shrinking drops the last rows and needs allow_shrink. Other files are copied; vocab_size is updated in model.yaml,
mindformers_model.yaml and conversion.json. The output directory is written atomically.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from labkit.errors import LabkitError
from labkit.io import atomic_dir
from labkit.logs import quiet_mindformers
from labkit.paths import lab_path

EMBED = "model.tok_embeddings.embedding_weight"
HEAD = "lm_head.weight"
REWRITTEN = ("model.ckpt", "model.yaml", "mindformers_model.yaml", "conversion.json")


def _read_source(src: Path, vocab_size: int, allow_shrink: bool) -> tuple[dict, int, bool]:
    """(model.yaml as a dict, old vocab size, tied) after checking the directory and the requested size."""
    import yaml

    ckpt, cfg_path = src / "model.ckpt", src / "model.yaml"
    for f in (ckpt, cfg_path):
        if not f.is_file():
            raise LabkitError(f"{f} not found", "point --model at a converted directory (labkit convert hf2ms)")
    if vocab_size <= 0:
        raise LabkitError(f"--vocab-size {vocab_size} must be positive")
    cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    old = int(cfg.get("vocab_size", 0))
    if vocab_size < old and not allow_shrink:
        raise LabkitError(f"--vocab-size {vocab_size} is smaller than the model's {old}: rows would be dropped",
                          "pass --allow-shrink if the last rows are unused, or check the tokenizer")
    return cfg, old, bool(cfg.get("tie_word_embeddings", False))


def _resized(params: dict, names: list, ckpt: Path, old: int, vocab_size: int) -> dict:
    """The embedding (and untied head) matrices with `vocab_size` rows: mean rows appended, or the last dropped."""
    import mindspore as ms
    import numpy as np

    for n in names:
        if n not in params:
            raise LabkitError(f"{ckpt} has no parameter {n}",
                              "is tie_word_embeddings right in model.yaml?" if n == HEAD else None)
        if params[n].shape[0] != old:
            raise LabkitError(f"{ckpt}: {n} has {params[n].shape[0]} rows but model.yaml says vocab_size {old}",
                              "the checkpoint and model.yaml disagree: fix model.yaml first")
    out = {}
    for n in names:
        p = params[n]
        w = p.astype(ms.float32).asnumpy()
        if vocab_size >= old:
            new = np.concatenate([w, np.repeat(w.mean(axis=0, keepdims=True), vocab_size - old, axis=0)])
        else:
            new = w[:vocab_size]
        out[n] = ms.Tensor(new, dtype=p.dtype)
    return out


def _write_side_files(src: Path, tmp: Path, cfg: dict, old: int, vocab_size: int, names: list) -> list[str]:
    """model.yaml, mindformers_model.yaml and conversion.json with the new vocab_size; other files copied."""
    import yaml

    cfg["vocab_size"] = vocab_size
    (tmp / "model.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    mf = src / "mindformers_model.yaml"
    if mf.is_file():
        text = mf.read_text(encoding="utf-8")
        head = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
        block = yaml.safe_load(text) or {}
        block.setdefault("model", {}).setdefault("model_config", {})["vocab_size"] = vocab_size
        (tmp / "mindformers_model.yaml").write_text(head + yaml.safe_dump(block, sort_keys=False), encoding="utf-8")
    rec_path = src / "conversion.json"
    if rec_path.is_file():
        rec = json.loads(rec_path.read_text(encoding="utf-8"))
        if isinstance(rec.get("hf_config"), dict):
            rec["hf_config"]["vocab_size"] = vocab_size
        rec.setdefault("resized_embeddings", []).append(
            dict(old_vocab_size=old, new_vocab_size=vocab_size, init="mean of existing rows", params=names))
        (tmp / "conversion.json").write_text(json.dumps(rec, indent=1), encoding="utf-8")
    copied = []
    for f in sorted(src.iterdir()):
        if f.name not in REWRITTEN:
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
            copied.append(f.name)
    return copied


def resize_embeddings(model_dir, vocab_size: int, output, *, allow_shrink: bool = False,
                      overwrite: bool = False) -> dict:
    """Give a converted checkpoint directory `vocab_size` embedding rows (and untied output rows); see the module
    docstring for how new rows start."""
    src = lab_path(model_dir)
    cfg, old, tied = _read_source(src, vocab_size, allow_shrink)
    quiet_mindformers()
    import mindspore as ms

    ckpt = src / "model.ckpt"
    params = ms.load_checkpoint(str(ckpt))
    names = [EMBED] + ([] if tied else [HEAD])
    resized = _resized(params, names, ckpt, old, vocab_size)
    with atomic_dir(output, overwrite=overwrite) as tmp:
        ms.save_checkpoint([{"name": n, "data": resized.get(n, p)} for n, p in params.items()], str(tmp / "model.ckpt"))
        copied = _write_side_files(src, tmp, cfg, old, vocab_size, names)
    return dict(ok=True, model=str(model_dir), output=str(output), old_vocab_size=old, new_vocab_size=vocab_size,
                rows_added=max(0, vocab_size - old), rows_dropped=max(0, old - vocab_size), params=names,
                init="mean of existing rows", copied_files=copied)
