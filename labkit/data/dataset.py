"""Offline tokenisation, packing into MindRecord, and the deterministic loader that training reads.

Build: documents are tokenised once (no BOS; EOS appended after every document), concatenated, and cut into samples
of `seq_len + 1` tokens (the model shifts inputs and labels itself); the tail that fills no sample is dropped and
counted (the tokenised corpus is held in memory, 4 bytes a token: fine for this lab's corpora, not for a
multi-billion-token one). The dataset directory appears only when complete (a temporary sibling, then renamed):
  data.mindrecord, data.mindrecord.db   column `input_ids`, int32, shape [seq_len + 1]
  doc_lengths.npy                       tokens per document (EOS included), for histograms
  token_counts.npy                      how often each token id occurs
  sample_docs.npy                       EOS tokens per sample (document ends), for shard-balance checks
  stats.json                            written last: counts, verdict, warnings, fingerprints, file sizes

Loader order (what training's exact resume and data-parallel equivalence rely on): epoch e is the permutation
`numpy.random.default_rng(seed + e).permutation(n_samples)`; optimizer step t takes the next
G = micro_batch * dp_size * accum samples; micro-step j takes G's slice [j*mb*dp, (j+1)*mb*dp) and rank r takes
[r*mb, (r+1)*mb) of that. An epoch's tail shorter than G is skipped. MindDataset reads an explicit index list
(SubsetSampler), so this is the rank sharding: MindDataset's own num_shards/shard_id would shard with its own
order, and 1 worker x micro_batch 2b would no longer see what 2 workers x b see.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from labkit.config import DataConfig
from labkit.data.corpus import ReadReport, fingerprint, read_documents
from labkit.data.quality import check_quality
from labkit.data.tokenizer import SHIPPED_TOKENIZER, load
from labkit.errors import LabkitError, LabkitFailure
from labkit.io import atomic_dir
from labkit.paths import ROOT, RUNS, lab_path

FORMAT = "labkit-dataset/1"
RECORD = "data.mindrecord"
VAL = "val"  # the validation set's subdirectory
CACHE = RUNS / "cache" / "datasets"
UNK_WARN, UNK_FAIL = 0.001, 0.05  # unk share of all tokens that warns / fails the build
DOMINANT_WARN, DOMINANT_FAIL = 0.20, 0.50  # share of the most frequent token (EOS excluded)
_BATCH_DOCS = 64  # documents per tokenizer call


# ------------------------------------------------------------------------------------------- building


def display_path(path) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def _tokenizer_files(tokenizer_dir) -> list[Path]:
    d = lab_path(tokenizer_dir)
    if not d.is_dir():
        raise LabkitError(f"tokenizer directory {tokenizer_dir} not found",
                          "give --tokenizer DIR (data/tokenizer is the shipped one; `labkit tokenizer train` makes one)")
    files = sorted(f for f in d.iterdir() if f.is_file())
    if not any(f.name in ("tokenizer.json", "tokenizer.model") for f in files):
        raise LabkitError(f"{d} has neither tokenizer.json nor tokenizer.model", "point --tokenizer at a tokenizer directory")
    return files


def _tokenizer_hash(tokenizer_dir) -> str:
    h = hashlib.sha256()
    for f in _tokenizer_files(tokenizer_dir):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


_WORKER_TOK = None


def load_fast_tokenizer(tokenizer_dir):
    from transformers.utils import logging as hf_logging


    hf_logging.set_verbosity_error()
    return load(tokenizer_dir, "hf")


def _worker_init(tokenizer_dir):
    global _WORKER_TOK
    _WORKER_TOK = load_fast_tokenizer(tokenizer_dir)


def _encode_batch(texts: list[str], tok=None) -> list[np.ndarray]:
    tok = tok or _WORKER_TOK
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(x, dtype=np.int32) for x in ids]


def _tokenize(docs: list[str], tokenizer_dir, workers: int, progress: bool, tok=None) -> list[np.ndarray]:
    from tqdm.auto import tqdm

    batches = [docs[i:i + _BATCH_DOCS] for i in range(0, len(docs), _BATCH_DOCS)]
    bar = tqdm(total=len(docs), desc="tokenise", unit="doc", file=sys.stderr, disable=not progress or None,
               leave=False)
    out: list[np.ndarray] = []
    try:
        if workers <= 1:
            tok = tok or load_fast_tokenizer(tokenizer_dir)
            for b in batches:
                out += _encode_batch(b, tok)
                bar.update(len(b))
        else:
            import multiprocessing as mp

            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            with ctx.Pool(workers, initializer=_worker_init, initargs=(str(lab_path(tokenizer_dir)),)) as pool:
                for b, ids in zip(batches, pool.imap(_encode_batch, batches)):
                    out += ids
                    bar.update(len(b))
    finally:
        bar.close()
    return out


def _verdict(n_tokens: int, counts: np.ndarray, unk_id: int, eos_id: int, tok, report) -> tuple[float, str, list]:
    warnings = report.summary()
    level = "warn" if warnings else "ok"
    unk_rate = float(counts[unk_id]) / max(n_tokens, 1) if unk_id is not None and unk_id < len(counts) else 0.0
    if unk_rate > UNK_WARN:
        warnings.append(f"unk_rate {unk_rate:.2%}: the tokenizer cannot represent part of this text "
                        "(no byte fallback, or the wrong tokenizer)")
        level = "fail" if unk_rate > UNK_FAIL else "warn"
    others = counts.copy()
    if eos_id is not None and eos_id < len(others):
        others[eos_id] = 0
    top = int(others.argmax())
    share = float(others[top]) / max(int(others.sum()), 1)
    if share > DOMINANT_WARN:
        warnings.append(f"token {top} ({tok.convert_ids_to_tokens(top)!r}) is {share:.0%} of all tokens: "
                        "check the text (repeated padding, markup, one character everywhere?)")
        level = "fail" if share > DOMINANT_FAIL else ("warn" if level == "ok" else level)
    return unk_rate, level, warnings


def _page_sizes(nbytes: int) -> tuple[int, int]:
    """MindRecord page and header sizes: small pages for small sets; a header with room for every page's meta."""
    page = 1 << 20 if nbytes < (1 << 30) else 1 << 25
    pages = nbytes // page + 2
    header = 1 << 16
    while header < pages * 1024 and header < (1 << 27):
        header <<= 1
    return page, header


def split_documents(n_docs: int, val_fraction: float, seed: int = 0) -> np.ndarray:
    """Indices of the documents held out for validation: round(val_fraction * n_docs) of them (at least one when
    val_fraction > 0), drawn by `numpy.random.default_rng(seed)`, sorted. Whole documents only: no document is cut
    between the two sets, so validation text is text the model never trained on."""
    if not 0 <= val_fraction < 1:
        raise LabkitError(f"--val-fraction {val_fraction} must be in [0, 1)", "use e.g. 0.02 (2% of the documents)")
    if val_fraction == 0:
        return np.zeros(0, dtype=np.int64)
    n_val = max(1, round(n_docs * val_fraction))
    if n_val >= n_docs:
        raise LabkitError(f"--val-fraction {val_fraction} of {n_docs} document(s) leaves none for training",
                          "give more documents or a smaller --val-fraction")
    return np.sort(np.random.default_rng(seed).choice(n_docs, n_val, replace=False))


def _pack(ids: list[np.ndarray], eos_id: int, sample_len: int) -> dict:
    """Documents + EOS concatenated and cut into samples of sample_len tokens (the tail that fills none dropped)."""
    eos = np.array([eos_id], dtype=np.int32)
    stream = np.concatenate([x for d in ids for x in (d, eos)]) if ids else np.zeros(0, np.int32)
    n_samples = stream.size // sample_len
    samples = stream[: n_samples * sample_len].reshape(n_samples, sample_len)
    return dict(stream=stream, samples=samples, doc_lengths=np.array([len(d) + 1 for d in ids], dtype=np.int32),
                sample_docs=(samples == eos_id).sum(axis=1).astype(np.int32))


def _write_set(d: Path, packed: dict, counts: np.ndarray, progress: bool) -> None:
    """data.mindrecord and the .npy side files of one packed set."""
    from mindspore.mindrecord import FileWriter
    from tqdm.auto import tqdm

    samples = packed["samples"]
    writer = FileWriter(str(d / RECORD), shard_num=1, overwrite=True)
    page, header = _page_sizes(samples.nbytes)
    writer.set_page_size(page)  # the defaults (32 MB pages, 16 MB header) pad a small set to 50 MB
    writer.set_header_size(header)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [samples.shape[1]]}}, "packed token ids")
    step = 1024
    for i in tqdm(range(0, len(samples), step), desc="write", unit="chunk", file=sys.stderr, leave=False,
                  disable=not progress or None):
        writer.write_raw_data([{"input_ids": s} for s in samples[i:i + step]])
    writer.commit()
    np.save(d / "doc_lengths.npy", packed["doc_lengths"])
    np.save(d / "token_counts.npy", counts)
    np.save(d / "sample_docs.npy", packed["sample_docs"])


def _set_stats(d: Path, packed: dict, n_docs: int, sample_len: int, common: dict) -> dict:
    """stats.json of one set (written last, with the sizes of the files beside it)."""
    n_tokens, n_samples = int(packed["stream"].size), len(packed["samples"])
    stats = dict(format=FORMAT, seq_len=sample_len - 1, sample_len=sample_len, n_documents=n_docs,
                 n_tokens=n_tokens, n_samples=n_samples, n_dropped_tokens=n_tokens - n_samples * sample_len,
                 **common, files={f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file()})
    (d / "stats.json").write_text(json.dumps(stats, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return stats


def _pack_split(ids: list[np.ndarray], val_idx: np.ndarray, eos_id: int, sample_len: int) -> tuple[dict, dict | None]:
    """The training set (every document not held out, in corpus order) and the validation set (or None), packed."""
    held = set(val_idx.tolist())
    train = _pack([d for i, d in enumerate(ids) if i not in held], eos_id, sample_len)
    val = _pack([ids[i] for i in val_idx], eos_id, sample_len) if held else None
    _check_sets(train, val, sample_len, len(held))
    return train, val


def _check_sets(train: dict, val: dict | None, sample_len: int, n_val_docs: int) -> None:
    n_tokens = int(train["stream"].size)
    if len(train["samples"]) == 0:
        raise LabkitError(f"the corpus gives {n_tokens} training tokens, fewer than one sample of seq_len + 1 = "
                          f"{sample_len}", "give more text or a smaller --seq-len")
    if val is not None and len(val["samples"]) == 0:
        raise LabkitError(f"the validation share ({n_val_docs} document(s), {val['stream'].size} tokens) fills no "
                          f"sample of seq_len + 1 = {sample_len} tokens",
                          "raise --val-fraction, give more text, use a smaller --seq-len, or --val-fraction 0")


def build_dataset(data: DataConfig, output_dir, *, workers: int = 1, text_field: str = "text",
                  split_on_blank_lines: bool = False, overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenise `data.corpus` (None: the shipped corpus) with `data.tokenizer`, pack into samples of
    data.seq_len + 1 tokens, write a MindRecord dataset; return the stats. With data.val_fraction > 0, a share of
    whole documents (seeded by data.val_seed) is packed separately into `<output>/val/` (its own MindRecord and
    stats.json); the training samples then come from the other documents only."""
    corpus, tokenizer_dir, seq_len = data.corpus, data.tokenizer, data.seq_len
    val_fraction, val_seed = data.val_fraction, data.val_seed

    if seq_len < 1 or workers < 1:
        raise LabkitError(f"--seq-len {seq_len} and --workers {workers} must be at least 1")
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise LabkitError(f"output directory {output_dir} already exists", "choose another --output or delete it")
    tok_hash = _tokenizer_hash(tokenizer_dir)
    t0 = time.perf_counter()
    report = ReadReport()
    docs = read_documents(corpus, text_field=text_field, split_on_blank_lines=split_on_blank_lines, report=report)
    val_idx = split_documents(len(docs), val_fraction, val_seed)
    tok = load_fast_tokenizer(tokenizer_dir)
    if tok.eos_token_id is None:
        raise LabkitError(f"tokenizer {tokenizer_dir} has no eos_token", "set eos_token in its tokenizer_config.json")
    t1 = time.perf_counter()
    ids = _tokenize(docs, tokenizer_dir, workers, progress, tok)
    t_tok = time.perf_counter() - t1
    sample_len = seq_len + 1
    train, val = _pack_split(ids, val_idx, tok.eos_token_id, sample_len)
    n_tokens = int(train["stream"].size)
    vocab = max(tok.get_vocab().values()) + 1
    if int(train["stream"].max()) >= vocab:
        raise LabkitFailure(f"token id {int(train['stream'].max())} is outside the tokenizer's {vocab} ids")
    counts = np.bincount(train["stream"], minlength=vocab).astype(np.int64)
    unk_rate, verdict, warnings = _verdict(n_tokens, counts, tok.unk_token_id, tok.eos_token_id, tok, report)
    quality = check_quality(ids, train["samples"], tok.all_special_ids)  # duplicates, special-token runs
    warnings += quality["warnings"]
    verdict = max(verdict, quality["verdict"], key=("ok", "warn", "fail").index)
    top = np.argsort(counts)[::-1][:10]
    common = dict(vocab_size=vocab, eos_id=tok.eos_token_id, bos_added=False, eos_between_documents=True,
                  tokenizer=display_path(lab_path(tokenizer_dir)), tokenizer_sha256=tok_hash,
                  corpus=[display_path(f) for f in report.files], corpus_sha256=fingerprint(corpus),
                  text_field=text_field, split_on_blank_lines=split_on_blank_lines,
                  val_fraction=val_fraction, val_seed=val_seed, n_val_documents=len(val_idx))
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        val_stats = None
        if val is not None:
            (tmp / VAL).mkdir()
            val_counts = np.bincount(val["stream"], minlength=vocab).astype(np.int64)
            _write_set(tmp / VAL, val, val_counts, progress)
            val_stats = _set_stats(tmp / VAL, val, len(val_idx), sample_len, dict(common, split="val"))
        _write_set(tmp, train, counts, progress)
        stats = _set_stats(tmp, train, len(docs) - len(val_idx), sample_len, dict(
            common, unk_rate=round(unk_rate, 6), verdict=verdict, warnings=warnings, quality=quality,
            top_tokens=[[int(i), tok.convert_ids_to_tokens(int(i)), round(float(counts[i]) / n_tokens, 4)]
                        for i in top], workers=workers, seconds=round(time.perf_counter() - t0, 2),
            tokenize_seconds=round(t_tok, 2), tokens_per_second=round(n_tokens / max(t_tok, 1e-9)),
            val_samples=len(val["samples"]) if val is not None else 0))
    return dict(ok=True, output=str(output_dir), **stats, val=val_stats)


def val_dir(dataset_dir) -> Path | None:
    """The validation set beside a dataset (`<dataset>/val`), or None when it was built with val_fraction 0."""
    d = lab_path(dataset_dir) / VAL
    return d if (d / "stats.json").is_file() else None


def read_samples(dataset_dir) -> np.ndarray:
    """Every sample of a (small) dataset in file order, int32 [n_samples, seq_len + 1]: the validation set."""
    import mindspore.dataset as ds

    n = read_stats(dataset_dir)["n_samples"]
    pipe = ds.MindDataset(str(lab_path(dataset_dir) / RECORD), columns_list=["input_ids"], shuffle=False)
    rows = [x for (x,) in pipe.create_tuple_iterator(output_numpy=True, num_epochs=1)]
    if len(rows) != n:
        raise LabkitFailure(f"{dataset_dir}: read {len(rows)} samples, stats.json says {n}",
                            "delete the dataset and build it again")
    return np.stack(rows).astype(np.int32)


def read_stats(dataset_dir) -> dict:
    """stats.json of a complete dataset; LabkitError when the directory is missing or incomplete."""
    d = lab_path(dataset_dir)
    if not d.is_dir():
        raise LabkitError(f"dataset directory {dataset_dir} not found",
                          "build it with `labkit data build --corpus ... --tokenizer ... --seq-len N --output DIR`")
    path = d / "stats.json"
    if not path.is_file():
        raise LabkitError(f"dataset {d} is incomplete (no stats.json): an interrupted or foreign build",
                          "delete the directory and build it again")
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LabkitError(f"{path} is not valid JSON ({e.msg})", "delete the dataset and build it again") from None
    if stats.get("format") != FORMAT:
        raise LabkitError(f"{d} is not a {FORMAT} dataset (format {stats.get('format')!r})", "build it again")
    bad = [n for n, size in stats.get("files", {}).items() if not (d / n).is_file() or (d / n).stat().st_size != size]
    if bad:
        raise LabkitError(f"dataset {d} is incomplete: {', '.join(bad)} missing or changed",
                          "delete the directory and build it again")
    return stats


def ensure_dataset(seq_len: int, corpus=None, tokenizer_dir=None, *, text_field: str = "text",
                   split_on_blank_lines: bool = False, progress: bool = True, val_fraction: float = 0.0,
                   val_seed: int = 0) -> Path:
    """The dataset for (corpus, tokenizer, seq_len), built on first use under runs/cache/datasets/<hash>/.

    Defaults: the shipped data/corpus and data/tokenizer. Several processes may ask at once (the workers of a
    first data-parallel run, notebooks started together): one builds while the others wait on a lock file beside it
    (`.lock-<hash>`, left in place) and then use its result. The build goes into a temporary directory renamed at
    the end, so a killed build leaves nothing a later call would read."""
    tokenizer_dir = lab_path(tokenizer_dir) if tokenizer_dir else SHIPPED_TOKENIZER
    # a validation split is part of the key; without one the key (and the cached set) is what it always was
    split = f"\0val{val_fraction!r}\0{val_seed}" if val_fraction else ""
    h = hashlib.sha256(f"{FORMAT}\0{fingerprint(corpus)}\0{_tokenizer_hash(tokenizer_dir)}\0{seq_len}\0"
                       f"{text_field}\0{split_on_blank_lines}{split}".encode()).hexdigest()[:20]
    final = CACHE / h
    if _usable(final):
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".lock-{h}", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if _usable(final):  # built while this call waited
            return final
        tmp = CACHE / f".build-{h}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        build_dataset(DataConfig(corpus=corpus, tokenizer=tokenizer_dir, seq_len=seq_len, val_fraction=val_fraction,
                                 val_seed=val_seed),
                      tmp, text_field=text_field, split_on_blank_lines=split_on_blank_lines, progress=progress)
        os.rename(tmp, final)
    return final


def _usable(final: Path) -> bool:
    """True when the cached dataset `final` is there and whole; a damaged one is moved aside (False)."""
    if not final.exists():
        return False
    try:
        read_stats(final)
        return True
    except LabkitError:  # damaged by hand: move it aside (another process may do the same)
        try:
            os.rename(final, final.with_name(f".stale-{final.name}-{uuid.uuid4().hex[:8]}"))
        except OSError:
            pass
        return False


# -------------------------------------------------------------------------------------------- loading


def histograms(dataset_dir) -> dict:
    """doc_lengths (tokens per document) and token_counts (occurrences per id) saved by the build."""
    d = lab_path(dataset_dir)
    read_stats(d)
    return dict(doc_lengths=np.load(d / "doc_lengths.npy"), token_counts=np.load(d / "token_counts.npy"))


# ------------------------------------------------------------------------------------------------ CLI


def format_build(r: dict) -> str:
    lines = [f"wrote {r['output']}: {r['n_samples']} samples of {r['sample_len']} tokens from {r['n_documents']} "
             f"documents ({r['n_tokens']} tokens, {r['n_dropped_tokens']} dropped), unk_rate {r['unk_rate']:.4%}, "
             f"{r['seconds']} s", f"verdict: {r['verdict']}"]
    if r.get("val"):
        v = r["val"]
        lines.insert(1, f"validation: {v['n_samples']} samples from {v['n_documents']} held-out documents "
                        f"({v['n_tokens']} tokens) in {r['output']}/{VAL}")
    return "\n".join(lines + [f"  warning: {w}" for w in r["warnings"]])
