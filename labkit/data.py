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

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from .errors import LabkitError, LabkitFailure
from .paths import RUNS, ROOT, atomic_dir, lab_path

FORMAT = "labkit-dataset/1"
RECORD = "data.mindrecord"
CACHE = RUNS / "cache" / "datasets"
UNK_WARN, UNK_FAIL = 0.001, 0.05  # unk share of all tokens that warns / fails the build
DOMINANT_WARN, DOMINANT_FAIL = 0.20, 0.50  # share of the most frequent token (EOS excluded)
_BATCH_DOCS = 64  # documents per tokenizer call


# ------------------------------------------------------------------------------------------- building


def _display(path) -> str:
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


def _load_fast(tokenizer_dir):
    from transformers.utils import logging as hf_logging

    from .tokenizer import load

    hf_logging.set_verbosity_error()
    return load(tokenizer_dir, "hf")


def _worker_init(tokenizer_dir):
    global _WORKER_TOK
    _WORKER_TOK = _load_fast(tokenizer_dir)


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
            tok = tok or _load_fast(tokenizer_dir)
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


def build_dataset(corpus, tokenizer_dir, seq_len: int, output_dir, workers: int = 1, text_field: str = "text",
                  split_on_blank_lines: bool = False, *, overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenise `corpus`, pack into samples of seq_len + 1 tokens, write a MindRecord dataset; return the stats."""
    from .corpus import ReadReport, fingerprint, read_documents

    if seq_len < 1:
        raise LabkitError(f"--seq-len {seq_len} must be at least 1")
    if workers < 1:
        raise LabkitError(f"--workers {workers} must be at least 1")
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise LabkitError(f"output directory {output_dir} already exists", "choose another --output or delete it")
    tok_hash = _tokenizer_hash(tokenizer_dir)
    t0 = time.perf_counter()
    report = ReadReport()
    docs = read_documents(corpus, text_field=text_field, split_on_blank_lines=split_on_blank_lines, report=report)
    tok = _load_fast(tokenizer_dir)
    eos_id, unk_id = tok.eos_token_id, tok.unk_token_id
    if eos_id is None:
        raise LabkitError(f"tokenizer {tokenizer_dir} has no eos_token", "set eos_token in its tokenizer_config.json")
    t1 = time.perf_counter()
    ids = _tokenize(docs, tokenizer_dir, workers, progress, tok)
    t_tok = time.perf_counter() - t1
    eos = np.array([eos_id], dtype=np.int32)
    stream = np.concatenate([x for d in ids for x in (d, eos)])
    doc_lengths = np.array([len(d) + 1 for d in ids], dtype=np.int32)
    sample_len = seq_len + 1
    n_tokens = int(stream.size)
    n_samples = n_tokens // sample_len
    if n_samples == 0:
        raise LabkitError(f"the corpus gives {n_tokens} tokens, fewer than one sample of seq_len + 1 = {sample_len}",
                          "give more text or a smaller --seq-len")
    vocab = max(tok.get_vocab().values()) + 1
    if int(stream.max()) >= vocab:
        raise LabkitFailure(f"token id {int(stream.max())} is outside the tokenizer's {vocab} ids")
    counts = np.bincount(stream, minlength=vocab).astype(np.int64)
    unk_rate, verdict, warnings = _verdict(n_tokens, counts, unk_id, eos_id, tok, report)
    samples = stream[: n_samples * sample_len].reshape(n_samples, sample_len)
    sample_docs = (samples == eos_id).sum(axis=1).astype(np.int32)
    top = np.argsort(counts)[::-1][:10]
    from mindspore.mindrecord import FileWriter
    from tqdm.auto import tqdm

    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        writer = FileWriter(str(tmp / RECORD), shard_num=1, overwrite=True)
        page, header = _page_sizes(samples.nbytes)
        writer.set_page_size(page)  # the defaults (32 MB pages, 16 MB header) pad a small set to 50 MB
        writer.set_header_size(header)
        writer.add_schema({"input_ids": {"type": "int32", "shape": [sample_len]}}, "packed token ids")
        step = 1024
        for i in tqdm(range(0, n_samples, step), desc="write", unit="chunk", file=sys.stderr, leave=False,
                      disable=not progress or None):
            writer.write_raw_data([{"input_ids": s} for s in samples[i:i + step]])
        writer.commit()
        np.save(tmp / "doc_lengths.npy", doc_lengths)
        np.save(tmp / "token_counts.npy", counts)
        np.save(tmp / "sample_docs.npy", sample_docs)
        seconds = time.perf_counter() - t0
        stats = dict(
            format=FORMAT, seq_len=seq_len, sample_len=sample_len, n_documents=len(docs), n_tokens=n_tokens,
            n_samples=n_samples, n_dropped_tokens=n_tokens - n_samples * sample_len, unk_rate=round(unk_rate, 6),
            verdict=verdict, warnings=warnings, vocab_size=vocab, eos_id=eos_id, bos_added=False,
            eos_between_documents=True, top_tokens=[[int(i), tok.convert_ids_to_tokens(int(i)),
                                                     round(float(counts[i]) / n_tokens, 4)] for i in top],
            tokenizer=_display(lab_path(tokenizer_dir)), tokenizer_sha256=tok_hash,
            corpus=[_display(f) for f in report.files], corpus_sha256=fingerprint(corpus), text_field=text_field,
            split_on_blank_lines=split_on_blank_lines, workers=workers, seconds=round(seconds, 2),
            tokenize_seconds=round(t_tok, 2), tokens_per_second=round(n_tokens / max(t_tok, 1e-9)),
            files={f.name: f.stat().st_size for f in sorted(tmp.iterdir())})
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return dict(ok=True, output=str(output_dir), **stats)


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
                   split_on_blank_lines: bool = False, progress: bool = True) -> Path:
    """The dataset for (corpus, tokenizer, seq_len), built on first use under runs/cache/datasets/<hash>/.

    Defaults: the shipped data/corpus and data/tokenizer. Safe when several processes call it at once: each builds
    into its own temporary directory and renames it; a loser of the race removes its copy and uses the winner's."""
    from .corpus import fingerprint
    from .tokenizer import SHIPPED_TOKENIZER

    tokenizer_dir = lab_path(tokenizer_dir) if tokenizer_dir else SHIPPED_TOKENIZER
    h = hashlib.sha256(f"{FORMAT}\0{fingerprint(corpus)}\0{_tokenizer_hash(tokenizer_dir)}\0{seq_len}\0"
                       f"{text_field}\0{split_on_blank_lines}".encode()).hexdigest()[:20]
    final = CACHE / h
    if final.exists():
        try:
            read_stats(final)
            return final
        except LabkitError:  # damaged by hand: move it aside (another process may do the same)
            try:
                os.rename(final, final.with_name(f".stale-{h}-{uuid.uuid4().hex[:8]}"))
            except OSError:
                pass
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f".build-{h}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build_dataset(corpus, tokenizer_dir, seq_len, tmp, text_field=text_field, split_on_blank_lines=split_on_blank_lines,
                  progress=progress)
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        read_stats(final)
    return final


# -------------------------------------------------------------------------------------------- loading


def epoch_order(n_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    return np.random.default_rng(seed + epoch).permutation(n_samples) if shuffle else np.arange(n_samples)


def global_batch_size(micro_batch: int, dp_size: int = 1, accum: int = 1) -> int:
    return micro_batch * dp_size * accum


def _check_layout(n_samples: int, micro_batch: int, dp_size: int, dp_rank: int, accum: int) -> int:
    for name, v in (("micro_batch", micro_batch), ("dp_size", dp_size), ("accum", accum)):
        if v < 1:
            raise LabkitError(f"{name} must be at least 1, got {v}")
    if not 0 <= dp_rank < dp_size:
        raise LabkitError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    g = global_batch_size(micro_batch, dp_size, accum)
    if n_samples < g:
        raise LabkitError(f"the dataset has {n_samples} samples, fewer than one global batch of {g} "
                          f"(micro_batch {micro_batch} x dp {dp_size} x accum {accum})",
                          f"give at least {g} samples (more text or a shorter seq_len) or a smaller batch")
    return n_samples // g


def rank_indices(n_samples: int, micro_batch: int, *, seed: int, epoch: int, dp_size: int = 1, dp_rank: int = 0,
                 accum: int = 1, shuffle: bool = True) -> np.ndarray:
    """Sample indices rank `dp_rank` reads in `epoch`: shape [steps_per_epoch, accum, micro_batch]."""
    steps = _check_layout(n_samples, micro_batch, dp_size, dp_rank, accum)
    g = global_batch_size(micro_batch, dp_size, accum)
    order = epoch_order(n_samples, seed, epoch, shuffle)[: steps * g]
    return order.reshape(steps, accum, dp_size, micro_batch)[:, :, dp_rank, :]


def make_loader(dataset_dir, micro_batch: int, *, seed: int, dp_size: int = 1, dp_rank: int = 0, accum: int = 1,
                start_step: int = 0, shuffle: bool = True, num_parallel_workers: int = 1, prefetch: int = 16):
    """Infinite iterator of int32 arrays [micro_batch, seq_len + 1]: `accum` of them per optimizer step, in the
    order described in the module docstring, starting at optimizer step `start_step` (skipped samples are not read)."""
    stats = read_stats(dataset_dir)
    n = stats["n_samples"]
    steps_per_epoch = _check_layout(n, micro_batch, dp_size, dp_rank, accum)
    if start_step < 0:
        raise LabkitError(f"start_step {start_step} must be >= 0")
    if num_parallel_workers < 1 or prefetch < 1:
        raise LabkitError("num_parallel_workers and prefetch must be at least 1")
    if num_parallel_workers > (os.cpu_count() or 1):
        raise LabkitError(f"num_parallel_workers {num_parallel_workers} exceeds this machine's {os.cpu_count()} CPUs "
                          "(MindSpore refuses more workers than CPUs)", f"use at most {os.cpu_count()}")
    record = str(lab_path(dataset_dir) / RECORD)

    def batches():
        from .model import quiet_mindformers

        quiet_mindformers()
        import mindspore.dataset as ds

        ds.config.set_prefetch_size(prefetch)
        step = start_step
        while True:
            epoch, first = divmod(step, steps_per_epoch)
            idx = rank_indices(n, micro_batch, seed=seed, epoch=epoch, dp_size=dp_size, dp_rank=dp_rank,
                               accum=accum, shuffle=shuffle)[first:]
            pipe = ds.MindDataset(record, columns_list=["input_ids"], sampler=ds.SubsetSampler(idx.ravel().tolist()),
                                  num_parallel_workers=num_parallel_workers)
            pipe = pipe.batch(micro_batch, drop_remainder=True)
            for (x,) in pipe.create_tuple_iterator(output_numpy=True, num_epochs=1):
                yield x
            step = (epoch + 1) * steps_per_epoch

    return batches()


def check_shard_balance(dataset_dir, micro_batch: int, dp_size: int, accum: int, steps: int, seed: int,
                        shuffle: bool = True) -> dict:
    """Tokens (and document ends) each data-parallel rank reads over `steps` optimizer steps.
    Packed samples all hold seq_len + 1 tokens, so tokens per rank are exactly equal; documents per rank are not."""
    stats = read_stats(dataset_dir)
    n, sample_len = stats["n_samples"], stats["sample_len"]
    spe = _check_layout(n, micro_batch, dp_size, 0, accum)
    sample_docs = np.load(lab_path(dataset_dir) / "sample_docs.npy")
    tokens, docs = [], []
    for r in range(dp_size):
        idx = [rank_indices(n, micro_batch, seed=seed, epoch=e, dp_size=dp_size, dp_rank=r, accum=accum,
                            shuffle=shuffle) for e in range(-(-steps // spe))]
        sel = np.concatenate(idx)[:steps].ravel()
        tokens.append(int(sel.size * sample_len))
        docs.append(int(sample_docs[sel].sum()))

    def imbalance(v):
        return (max(v) - min(v)) / max(np.mean(v), 1e-9)

    return dict(dp_size=dp_size, steps=steps, micro_batch=micro_batch, accum=accum,
                tokens_per_rank=tokens, documents_per_rank=docs, max_imbalance=round(imbalance(tokens), 6),
                document_imbalance=round(imbalance(docs), 6))


def histograms(dataset_dir) -> dict:
    """doc_lengths (tokens per document) and token_counts (occurrences per id) saved by the build."""
    d = lab_path(dataset_dir)
    read_stats(d)
    return dict(doc_lengths=np.load(d / "doc_lengths.npy"), token_counts=np.load(d / "token_counts.npy"))


# ---------------------------------------------------------------------------------------------- bench


class _Docs:
    """Random-access source for GeneratorDataset: one raw document per row."""

    def __init__(self, docs: list[str]):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return (np.array(self.docs[i]),)


class _Tokenize:
    """Map operation: raw text -> int32 ids + EOS (loads the tokenizer once per worker)."""

    def __init__(self, tokenizer_dir: str):
        self.dir, self.tok = tokenizer_dir, None

    def __call__(self, text):
        if self.tok is None:
            self.tok = _load_fast(self.dir)
        ids = self.tok(str(text), add_special_tokens=False)["input_ids"]
        return np.asarray(ids + [self.tok.eos_token_id], dtype=np.int32)


def bench_on_the_fly(docs: list[str], tokenizer_dir, workers: int) -> dict:
    """Tokens/s of GeneratorDataset(raw text) -> map(tokenise) with `workers` (processes when > 1)."""
    import mindspore.dataset as ds

    t0 = time.perf_counter()
    pipe = ds.GeneratorDataset(_Docs(docs), column_names=["text"], shuffle=False)
    pipe = pipe.map(operations=_Tokenize(str(lab_path(tokenizer_dir))), input_columns=["text"],
                    output_columns=["input_ids"], num_parallel_workers=workers, python_multiprocessing=workers > 1)
    tokens = sum(x.size for (x,) in pipe.create_tuple_iterator(output_numpy=True, num_epochs=1))
    secs = time.perf_counter() - t0
    return dict(pipeline="on-the-fly", workers=workers, prefetch=None, tokens=int(tokens), seconds=round(secs, 3),
                tokens_per_s=round(tokens / secs))


def bench_mindrecord(dataset_dir, workers: int, prefetch: int, micro_batch: int = 8,
                     max_samples: int | None = None) -> dict:
    """Tokens/s of the training loader (make_loader: MindDataset + shuffled index list) over one epoch."""
    stats = read_stats(dataset_dir)
    n = min(stats["n_samples"], max_samples or stats["n_samples"]) // micro_batch
    t0 = time.perf_counter()
    it = make_loader(dataset_dir, micro_batch, seed=0, num_parallel_workers=workers, prefetch=prefetch)
    tokens = sum(next(it).size for _ in range(n))
    secs = time.perf_counter() - t0
    return dict(pipeline="MindRecord", workers=workers, prefetch=prefetch, tokens=int(tokens), seconds=round(secs, 3),
                tokens_per_s=round(tokens / secs))


def run_bench(corpus=None, tokenizer_dir=None, seq_len: int = 128, workers=(1, 2, 4), prefetch=(16, 64),
              max_docs: int | None = None, dataset_dir=None) -> dict:
    """Both pipelines at every worker count (MindRecord also at every prefetch), in one run, with the ratio."""
    import platform

    from .corpus import read_documents
    from .model import quiet_mindformers
    from .tokenizer import SHIPPED_TOKENIZER

    quiet_mindformers()
    tokenizer_dir = tokenizer_dir or SHIPPED_TOKENIZER
    dataset_dir = dataset_dir or ensure_dataset(seq_len, corpus, tokenizer_dir)
    docs = read_documents(corpus)[:max_docs]
    _load_fast(tokenizer_dir)  # import transformers once, outside the timings
    cpus = os.cpu_count() or 1
    rows, refused = [], []
    for w in workers:
        if w > cpus:  # MindSpore raises ValueError for num_parallel_workers above the CPU count
            refused.append(w)
            continue
        rows.append(bench_on_the_fly(docs, tokenizer_dir, w))
        for p in prefetch:
            rows.append(bench_mindrecord(dataset_dir, w, p))
    if not rows:
        raise LabkitError(f"no worker count in {list(workers)} is allowed on {cpus} CPUs", f"use 1..{cpus}")
    r = dict(ok=True, machine=dict(cpus=cpus, processor=platform.processor() or platform.machine()),
             seq_len=seq_len, n_docs=len(docs), dataset=_display(dataset_dir), rows=rows, refused_workers=refused)
    r.update(summarize_rows(rows, prefetch))
    return r


def summarize_rows(rows: list[dict], prefetch) -> dict:
    """Ratios and speed-ups from bench rows (MindRecord figures at the first prefetch size)."""
    fly = {r["workers"]: r["tokens_per_s"] for r in rows if r["pipeline"] == "on-the-fly"}
    mr = {r["workers"]: r["tokens_per_s"] for r in rows if r["pipeline"] == "MindRecord" and r["prefetch"] == prefetch[0]}
    w1 = min(fly)
    return dict(ratio_by_workers={w: round(mr[w] / fly[w], 1) for w in fly},
                mindrecord_saving=round(1 - max(fly.values()) / max(mr.values()), 4),  # time per token, best vs best
                on_the_fly_speedup_by_workers={w: round(fly[w] / fly[w1], 2) for w in fly},
                mindrecord_speedup_by_workers={w: round(mr[w] / mr[w1], 2) for w in mr},
                mindrecord_tokens_per_s_by_prefetch={
                    p: max(r["tokens_per_s"] for r in rows if r["pipeline"] == "MindRecord" and r["prefetch"] == p)
                    for p in prefetch})


def check_claims(r: dict, loader_tokens_per_s: float, tokens_per_step: int, step_seconds: float | None) -> list:
    """The seeds' data-pipeline claims against this machine's bench numbers."""
    out = []
    saving = r["mindrecord_saving"]
    out.append(dict(claim="MindRecord saves 90% of preprocessing time", value=saving,
                    verdict="held" if saving >= 0.9 else "did not hold",
                    evidence=f"time per token saved by reading packed ids instead of tokenising on the fly: "
                             f"{saving:.1%} (ratio {1 / max(1 - saving, 1e-9):.1f}x, best vs best)"))
    load_s = tokens_per_step / loader_tokens_per_s
    cpus = r["machine"]["cpus"]
    ev = (f"MindSpore refuses num_parallel_workers above the CPU count ({cpus} here); the loader needs "
          f"{load_s * 1e3:.2f} ms per step of {tokens_per_step} tokens")
    if step_seconds is None:
        out.append(dict(claim="16 workers cut step time 25%", value=None, verdict="not measured", evidence=ev))
    else:
        share = load_s / step_seconds
        out.append(dict(claim="16 workers cut step time 25%", value=round(share, 5),
                        verdict="held" if share >= 0.25 else "did not hold",
                        evidence=ev + f", the tiny model {step_seconds * 1e3:.0f} ms: loading is {share:.2%} of a "
                                      f"step, so no worker count can cut step time by more than that"))
    pf = r["mindrecord_tokens_per_s_by_prefetch"]
    if len(pf) >= 2:
        lo, hi = min(pf), max(pf)
        gain = pf[hi] / pf[lo] - 1
        out.append(dict(claim=f"prefetch {hi} instead of {lo} speeds up loading", value=round(gain, 3),
                        verdict="held" if gain >= 0.1 else "did not hold",
                        evidence=f"MindRecord loader {pf[lo]:,} vs {pf[hi]:,} tokens/s ({gain:+.0%}); either is "
                                 f"far faster than the model consumes"))
    return out


def model_step_seconds(seq_len: int = 128, micro_batch: int = 8, steps: int = 2, preset: str = "tiny") -> float:
    """Seconds per training step (forward, backward, AdamW; graph mode) of a model preset on this machine, to put
    the loader's time per step in proportion. Compilation is excluded."""
    from mindspore import nn

    import mindspore as ms

    from .config import model_preset
    from .model import build_model

    from .tokenizer import _quiet_mindformers_console

    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = model_preset(preset)
    import mindformers  # noqa: F401  (its logger exists only after import)

    _quiet_mindformers_console()
    model = build_model(cfg, seq_length=seq_len, batch_size=micro_batch, seed=0)
    model.set_train(True)
    step = nn.TrainOneStepCell(model, nn.AdamWeightDecay(model.trainable_params(), 1e-4))
    x = ms.Tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (micro_batch, seq_len + 1)), ms.int32)
    step(x).asnumpy()  # compile
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x).asnumpy()
    return (time.perf_counter() - t0) / steps


def format_table(r: dict) -> str:
    lines = [f"data pipeline bench: {r['machine']['cpus']} CPUs, seq_len {r['seq_len']}, {r['n_docs']} docs on the fly",
             f"{'pipeline':<12} {'workers':>7} {'prefetch':>8} {'tokens':>10} {'seconds':>8} {'tokens/s':>12}"]
    for row in r["rows"]:
        lines.append(f"{row['pipeline']:<12} {row['workers']:>7} {row['prefetch'] or '-':>8} {row['tokens']:>10} "
                     f"{row['seconds']:>8.2f} {row['tokens_per_s']:>12,}")
    lines.append("ratio MindRecord / on-the-fly (same workers): "
                 + ", ".join(f"{w} workers {v}x" for w, v in r["ratio_by_workers"].items()))
    lines.append(f"preprocessing time saved by MindRecord (best vs best): {r['mindrecord_saving']:.1%}")
    if r["refused_workers"]:
        lines.append(f"not run: workers {r['refused_workers']} (MindSpore refuses num_parallel_workers above the "
                     f"{r['machine']['cpus']} CPUs)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI


def add_cli(parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    b = sub.add_parser("build", help="tokenise a corpus offline and pack it into a MindRecord dataset")
    b.add_argument("--corpus", nargs="+", required=True, help=".txt/.jsonl files (or .gz) or directories")
    b.add_argument("--tokenizer", required=True, help="tokenizer directory (data/tokenizer is the shipped one)")
    b.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence (samples hold one more)")
    b.add_argument("--output", required=True, help="dataset directory to write (atomically)")
    b.add_argument("--workers", type=int, default=1, help="tokenising processes")
    b.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl files")
    b.add_argument("--split-on-blank-lines", action="store_true", help=".txt: one document per blank-line block")
    b.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    b.set_defaults(func=_cli_build)

    n = sub.add_parser("bench", help="tokens/s: on-the-fly tokenisation (GeneratorDataset) vs packed MindRecord")
    n.add_argument("--corpus", nargs="+", default=None, help="corpus (default: the shipped data/corpus)")
    n.add_argument("--tokenizer", default=None, help="tokenizer directory (default: data/tokenizer)")
    n.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    n.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="num_parallel_workers values")
    n.add_argument("--prefetch", type=int, nargs="+", default=[16, 64], help="prefetch sizes (MindRecord loader)")
    n.add_argument("--max-docs", type=int, default=None, help="documents for the on-the-fly runs (default: all)")
    n.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    n.set_defaults(func=_cli_bench)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def format_build(r: dict) -> str:
    lines = [f"wrote {r['output']}: {r['n_samples']} samples of {r['sample_len']} tokens from {r['n_documents']} "
             f"documents ({r['n_tokens']} tokens, {r['n_dropped_tokens']} dropped), unk_rate {r['unk_rate']:.4%}, "
             f"{r['seconds']} s", f"verdict: {r['verdict']}"]
    return "\n".join(lines + [f"  warning: {w}" for w in r["warnings"]])


def _cli_build(args) -> int:
    from .cli import emit

    r = build_dataset(args.corpus, args.tokenizer, args.seq_len, args.output, workers=args.workers,
                      text_field=args.text_field, split_on_blank_lines=args.split_on_blank_lines,
                      overwrite=args.overwrite)
    emit(args, r, format_build(r))
    return 1 if r["verdict"] == "fail" else 0


def _cli_bench(args) -> int:
    from .cli import emit

    r = run_bench(corpus=args.corpus, tokenizer_dir=args.tokenizer, seq_len=args.seq_len, workers=args.workers,
                  prefetch=args.prefetch, max_docs=args.max_docs)
    emit(args, r, format_table(r))
    return 0
