"""labkit.data.quality: duplicated documents/samples and special-token runs, found by the build before training."""
import json

import numpy as np

from labkit.config import DataConfig
from labkit.data import dataset as D
from labkit.data.corpus import read_documents
from labkit.data.quality import RUN_WARN, check_quality, duplicates, longest_special_run
from labkit.data.tokenizer import SHIPPED_TOKENIZER

SPECIAL = (0, 1, 2)


def test_longest_special_run_counts_mixed_specials_and_ignores_ordinary_tokens():
    assert longest_special_run(np.array([5, 2, 2, 1, 2, 7, 2, 9]), SPECIAL) == 4
    assert longest_special_run(np.array([5, 6, 7]), SPECIAL) == 0
    assert longest_special_run(np.array([2] * 30), SPECIAL) == 30


def test_duplicates_are_counted_after_their_first_occurrence():
    rows = [np.arange(20), np.arange(1, 21), np.arange(20), np.arange(20)]
    assert duplicates(rows) == (2, [2, 3])


def test_clean_random_text_passes_and_dirty_text_is_caught():
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 4096, size=200).astype(np.int32) for _ in range(50)]
    samples = np.concatenate(docs)[: 50 * 200 // 33 * 33].reshape(-1, 33)
    clean = check_quality(docs, samples, SPECIAL)
    assert clean["verdict"] == "ok" and clean["warnings"] == []
    dirty_docs = docs + [docs[3].copy(), docs[7].copy(), np.full(64, 2, np.int32)]
    dirty_samples = np.concatenate([samples, samples[:2], np.full((1, 33), 2, np.int32)])
    q = check_quality(dirty_docs, dirty_samples, SPECIAL)
    assert q["duplicate_documents"] == 2 and q["duplicate_document_examples"] == [50, 51]
    assert q["duplicate_samples"] == 2 and q["longest_special_run"] == 64
    assert q["special_run_document_count"] == 1 and q["special_heavy_sample_count"] == 1
    assert q["verdict"] == "warn" and len(q["warnings"]) == 3


def test_short_repeated_headings_and_a_few_eos_are_not_flagged():
    heading = np.array([100, 101, 102], np.int32)  # "CHAPTER I": short, repeats in real books
    docs = [heading, np.arange(3, 40, dtype=np.int32), heading, np.arange(50, 90, dtype=np.int32)]
    samples = np.array([[5, 2, 2, 6] * 8 + [7]], np.int32)  # two empty documents in a row: a run of 2
    q = check_quality(docs, samples, SPECIAL)
    assert q["verdict"] == "ok" and q["duplicate_documents"] == 0 and q["longest_special_run"] < RUN_WARN


def test_the_build_reports_a_dirty_corpus_in_its_stats(tmp_path):
    docs = read_documents()[:30]
    dirty = docs + docs[:4] + ["</s>" * 40 + " hello"]
    corpus = tmp_path / "dirty.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in dirty), encoding="utf-8")
    stats = D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=64),
                            tmp_path / "ds", progress=False)
    q = stats["quality"]
    assert q["duplicate_documents"] == 4 and q["longest_special_run"] == 40
    assert stats["verdict"] == "warn" and any("repeat an earlier one" in w for w in stats["warnings"])
    assert D.read_stats(tmp_path / "ds")["quality"] == q
