"""labkit.data.corpus: what counts as a document, and how bad input is named."""
import gzip
import json

import pytest

from labkit.data.corpus import SHIPPED_CORPUS, ReadReport, corpus_files, fingerprint, read_documents
from labkit.errors import LabkitError


def test_txt_is_one_document_per_file(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\nsecond block\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("another file", encoding="utf-8")
    docs = read_documents([tmp_path])
    assert docs == ["first line\n\nsecond block\n", "another file"]


def test_split_on_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("p1 l1\np1 l2\n\n\np2\n  \np3\n", encoding="utf-8")
    assert read_documents([tmp_path / "a.txt"], split_on_blank_lines=True) == ["p1 l1\np1 l2", "p2", "p3"]


def test_jsonl_text_field_and_gzip(tmp_path):
    rows = [{"body": "甲乙丙"}, {"body": "one two"}]
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    assert read_documents([tmp_path / "c.jsonl.gz"], text_field="body") == ["甲乙丙", "one two"]


def test_jsonl_missing_field_names_file_line_and_fix(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"content": "no text"}\n', encoding="utf-8")
    with pytest.raises(LabkitError) as e:
        read_documents([p])
    assert f"{p}:2" in e.value.what and "'text'" in e.value.what and "content" in e.value.what
    assert "--text-field" in e.value.fix


def test_jsonl_invalid_json(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(LabkitError, match=r"e\.jsonl:2 is not valid JSON"):
        read_documents([p])


def test_binary_file_is_refused(tmp_path):
    p = tmp_path / "blob.txt"
    p.write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    with pytest.raises(LabkitError, match="binary"):
        read_documents([p])


def test_non_utf8_line_is_skipped_and_named(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("good line\n".encode() + "caf\xe9\n".encode("latin-1") + b"more\n")
    report = ReadReport()
    docs = read_documents([p], report=report)
    assert docs == ["good line\nmore\n"]
    assert report.n_bad_lines == 1 and f"{p}:2 is not UTF-8" in report.warnings[0]


def test_empty_documents_are_counted(tmp_path):
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    (tmp_path / "b.txt").write_text("  \n\n", encoding="utf-8")
    report = ReadReport()
    assert read_documents([tmp_path], report=report) == ["text"]
    assert report.n_empty == 1 and "1 empty document(s) skipped" in report.summary()


def test_empty_corpus_and_bad_paths(tmp_path):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(LabkitError, match="holds no text"):
        read_documents([tmp_path / "empty.txt"])
    with pytest.raises(LabkitError, match="does not exist"):
        corpus_files([tmp_path / "nope"])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(LabkitError, match="holds no"):
        corpus_files([tmp_path / "sub"])
    with pytest.raises(LabkitError, match="is not one of"):
        corpus_files([tmp_path / "sub" / "x.csv"])


def test_shipped_corpus_has_both_languages():
    files = corpus_files(None)
    assert [f.parent for f in files] == [SHIPPED_CORPUS] * len(files)
    docs = read_documents()
    assert len(docs) == 5922
    text = "".join(docs)
    assert 4_000_000 < len(text.encode()) < 7_000_000
    assert "It is a truth universally acknowledged" in text and "关关雎鸠" in text


def test_fingerprint_follows_content(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("one", encoding="utf-8")
    h1 = fingerprint([p])
    p.write_text("two", encoding="utf-8")
    assert fingerprint([p]) != h1
    assert fingerprint([p]) == fingerprint([tmp_path])


def test_truncated_gzip_is_named(tmp_path):
    import gzip

    from labkit.data.corpus import read_documents

    data = gzip.compress(("\n".join('{"text": "document %d"}' % i for i in range(5000))).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(LabkitError, match=r"cut.jsonl.gz is a damaged gzip file .*line\(s\) readable"):
        read_documents(cut)
