"""Reading a text corpus: `.txt` and `.jsonl` files (optionally `.gz`), or directories of them.

One `.txt` file is one document, or one document per blank-line-separated block with
`split_on_blank_lines=True`; every line of a `.jsonl` file is one JSON object whose `text_field` holds the document.
Problems are reported, not hidden: a binary file or a malformed JSON line is an error naming the file and the line;
a line that is not UTF-8 is skipped and named in the warnings; empty documents are skipped and counted.

The shipped corpus lives in `data/corpus/` (see `data/README.md` for its provenance and licences).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from labkit.errors import LabkitError
from labkit.paths import DATA, lab_path

SHIPPED_CORPUS = DATA / "corpus"
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")
_MAX_WARNINGS = 20  # individual problems listed; the rest are counted


@dataclass
class Document:
    text: str
    where: str  # "file" or "file:line" (1-based), for messages


@dataclass
class ReadReport:
    """What reading found besides the documents: skipped lines and documents, by place."""

    files: list[str] = field(default_factory=list)
    n_documents: int = 0
    n_empty: int = 0
    n_bad_lines: int = 0
    warnings: list[str] = field(default_factory=list)

    def warn(self, msg: str) -> None:
        if len(self.warnings) < _MAX_WARNINGS:
            self.warnings.append(msg)

    def summary(self) -> list[str]:
        out = list(self.warnings)
        if self.n_empty:
            out.append(f"{self.n_empty} empty document(s) skipped")
        if self.n_bad_lines > _MAX_WARNINGS:
            out.append(f"{self.n_bad_lines} non-UTF-8 line(s) skipped in total (first {_MAX_WARNINGS} listed)")
        return out


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return "jsonl" if "jsonl" in suffix else "txt"
    return None


def corpus_files(paths: list | str | os.PathLike | None = None) -> list[Path]:
    """Expand files and directories (recursively, sorted) into the corpus files. None = the shipped corpus."""
    if paths is None:
        paths = [SHIPPED_CORPUS]
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        path = lab_path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and _kind(f) and not f.name.startswith("."))
            if not found:
                raise LabkitError(f"corpus directory {path} holds no {', '.join(SUFFIXES)} files",
                                  "point --corpus at text files, or put .txt/.jsonl files in that directory")
            files += found
        elif path.is_file():
            if not _kind(path):
                raise LabkitError(f"corpus file {path} is not one of {', '.join(SUFFIXES)}",
                                  "rename it, or convert it to plain text (.txt) or JSON lines (.jsonl)")
            files.append(path)
        else:
            raise LabkitError(f"corpus path {p} does not exist", "check the path (relative to where you run the command)")
    if not files:
        raise LabkitError("no corpus given", "pass --corpus PATH (a .txt/.jsonl file or a directory)")
    return files


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _check_not_binary(path: Path) -> None:
    try:
        with _open_bytes(path) as f:
            head = f.read(8192)
    except (OSError, EOFError) as e:  # e.g. a file named .gz that is not gzip
        raise LabkitError(f"cannot read {path}: {e}", "check that the file is what its name says") from None
    if b"\x00" in head:
        raise LabkitError(f"{path} looks like a binary file (it contains NUL bytes)",
                          "give text files only: UTF-8 .txt or .jsonl, optionally gzipped")


def _raw_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes; a damaged gzip stream (truncated, corrupt) is an error naming the file."""
    import zlib

    no = 0
    try:
        with _open_bytes(path) as f:
            for no, raw in enumerate(f, 1):
                yield raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise LabkitError(f"{path} is a damaged gzip file ({e}; {no} line(s) readable before the damage)",
                          "copy or download it again (`gzip -t FILE` checks a file), or leave it out of --corpus"
                          ) from None


def _lines(path: Path, report: ReadReport) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line with its newline) for each UTF-8 line; bad lines are skipped and named."""
    for no, raw in enumerate(_raw_lines(path), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            report.n_bad_lines += 1
            report.warn(f"{path}:{no} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); line skipped")
            continue
        if no == 1 and line.startswith("\ufeff"):
            line = line[1:]
        yield no, line


def _txt_documents(path: Path, split_on_blank_lines: bool, report: ReadReport) -> Iterator[Document]:
    if not split_on_blank_lines:
        text = "".join(line for _, line in _lines(path, report))
        yield Document(text.replace("\r\n", "\n"), str(path))
        return
    block: list[str] = []
    start = 1
    for no, line in _lines(path, report):
        if line.strip():
            if not block:
                start = no
            block.append(line.replace("\r\n", "\n"))
        elif block:
            yield Document("".join(block).rstrip("\n"), f"{path}:{start}")
            block = []
    if block:
        yield Document("".join(block).rstrip("\n"), f"{path}:{start}")


def _jsonl_documents(path: Path, text_field: str, report: ReadReport) -> Iterator[Document]:
    for no, line in _lines(path, report):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise LabkitError(f"{path}:{no} is not valid JSON ({e.msg} at column {e.colno})",
                              "each line of a .jsonl file must be one JSON object") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise LabkitError(f"{path}:{no} has no field '{text_field}' (found: {keys})",
                              "choose the field with --text-field NAME")
        text = record[text_field]
        if not isinstance(text, str):
            raise LabkitError(f"{path}:{no}: field '{text_field}' is {type(text).__name__}, not a string",
                              "choose a text field with --text-field NAME")
        yield Document(text, f"{path}:{no}")


def iter_documents(paths=None, *, text_field: str = "text", split_on_blank_lines: bool = False,
                   report: ReadReport | None = None) -> Iterator[Document]:
    """Yield the non-empty documents of a corpus in a fixed order (files sorted within directories)."""
    report = report if report is not None else ReadReport()
    for path in corpus_files(paths):
        _check_not_binary(path)
        report.files.append(str(path))
        docs = (_jsonl_documents(path, text_field, report) if _kind(path) == "jsonl"
                else _txt_documents(path, split_on_blank_lines, report))
        for doc in docs:
            if not doc.text.strip():
                report.n_empty += 1
                continue
            report.n_documents += 1
            yield doc


def read_documents(paths=None, *, text_field: str = "text", split_on_blank_lines: bool = False,
                   report: ReadReport | None = None) -> list[str]:
    """All document texts; raises LabkitError when the corpus holds no text at all."""
    report = report if report is not None else ReadReport()
    docs = [d.text for d in iter_documents(paths, text_field=text_field, split_on_blank_lines=split_on_blank_lines,
                                           report=report)]
    if not docs:
        raise LabkitError(f"the corpus ({', '.join(report.files) or 'no files'}) holds no text",
                          "give files with some text in them" + (f" (also check --text-field '{text_field}')"
                                                                 if any(f.endswith(('.jsonl', '.jsonl.gz'))
                                                                        for f in report.files) else ""))
    return docs


def fingerprint(paths=None) -> str:
    """sha256 over the corpus files' names, sizes and contents (what a cached dataset depends on)."""
    h = hashlib.sha256()
    for path in corpus_files(paths):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
