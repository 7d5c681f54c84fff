"""Data-quality checks a build runs before any training: duplicated documents and samples, and runs of repeated
special tokens (a scraped page of `</s></s></s>…`, padding written into the text, a broken template).

Why they matter: a duplicated document is trained on several times per epoch (memorised, and its weight in the
mix silently multiplied); a sample made of one special token repeated has a trivially predictable target, so its
loss collapses toward zero while its gradient points somewhere no real text does, which is what the seeds blame for
loss oscillation in fp16. Both are cheap to find in token ids, so the build looks before training does.
"""
from __future__ import annotations

import hashlib

import numpy as np

MIN_DOC_TOKENS = 16  # shorter documents (headings, "CHAPTER I") repeat legitimately and are not counted
DUP_WARN, DUP_FAIL = 0.01, 0.20  # share of (long enough) documents that repeat an earlier one
RUN_WARN = 8  # a run of this many consecutive special tokens inside one document is never natural text
SPECIAL_SAMPLE_SHARE = 0.5  # a training sample more than half special tokens is flagged


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.int32).tobytes(), digest_size=16).digest()


def duplicates(rows) -> tuple[int, list[int]]:
    """(number of rows equal to an earlier row, indices of the first few of them)."""
    seen, dup = set(), []
    for i, row in enumerate(rows):
        h = _digest(row)
        if h in seen:
            dup.append(i)
        seen.add(h)
    return len(dup), dup[:10]


def longest_special_run(ids: np.ndarray, special_ids) -> int:
    """Longest stretch of consecutive special tokens (any mix of them) in one token array."""
    mask = np.isin(np.asarray(ids), np.asarray(list(special_ids)))
    if not mask.any():
        return 0
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())


def check_quality(docs: list[np.ndarray], samples: np.ndarray, special_ids) -> dict:
    """The quality section of a dataset's stats.json: counts, examples, warnings and a verdict (ok | warn | fail)."""
    special = sorted(int(i) for i in special_ids if i is not None)
    long_docs = [d for d in docs if len(d) >= MIN_DOC_TOKENS]
    n_dup_docs, dup_doc_idx = duplicates(long_docs)
    n_dup_samples, dup_sample_idx = duplicates(samples)
    runs = [longest_special_run(d, special) for d in docs]
    bad_docs = [i for i, r in enumerate(runs) if r >= RUN_WARN]
    share = np.isin(samples, special).mean(axis=1) if len(samples) else np.zeros(0)
    bad_samples = np.flatnonzero(share > SPECIAL_SAMPLE_SHARE)
    dup_share = n_dup_docs / max(len(long_docs), 1)
    warnings, level = [], "ok"
    if n_dup_docs and dup_share >= DUP_WARN:
        warnings.append(f"{n_dup_docs} of {len(long_docs)} documents ({dup_share:.1%}) repeat an earlier one "
                        f"(first at document index {dup_doc_idx[0]} of those with >= {MIN_DOC_TOKENS} tokens): "
                        "deduplicate the corpus")
        level = "fail" if dup_share >= DUP_FAIL else "warn"
    if n_dup_samples:
        warnings.append(f"{n_dup_samples} training samples are exact copies of earlier ones "
                        f"(first: sample {dup_sample_idx[0]})")
        level = "warn" if level == "ok" else level
    if bad_docs or len(bad_samples):
        warnings.append(f"{len(bad_docs)} documents hold a run of >= {RUN_WARN} special tokens (longest "
                        f"{max(runs)}, document {bad_docs[0] if bad_docs else '-'}); {len(bad_samples)} samples are "
                        f"more than {SPECIAL_SAMPLE_SHARE:.0%} special tokens: strip special-token text from the "
                        "corpus")
        level = "warn" if level == "ok" else level
    return {"duplicate_documents": n_dup_docs, "documents_checked": len(long_docs),
            "duplicate_document_share": round(dup_share, 4), "duplicate_document_examples": dup_doc_idx,
            "duplicate_samples": n_dup_samples, "duplicate_sample_examples": dup_sample_idx,
            "longest_special_run": max(runs, default=0), "special_run_documents": bad_docs[:10],
            "special_run_document_count": len(bad_docs), "special_heavy_samples": bad_samples[:10].tolist(),
            "special_heavy_sample_count": int(len(bad_samples)), "special_ids": special,
            "verdict": level, "warnings": warnings}
