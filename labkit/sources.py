"""What a cached result was made from, as one key: a sha256 over the text of every labkit module its entry point
imports, transitively, and of the data files named. A cache is fresh exactly when the key it stored is today's.

    key = source_key("labkit.byhand.runs", data=["data/corpus"])   # a module's name, or a script's path
    ...run it...; stamp(folder / "DONE", key)
    fresh = stamped(folder / "DONE", key)

Why not modification times against a hand-kept list of files: a time says when a file was touched, not whether
it changed (a checkout touches everything, a copy may keep old times), and a list forgets the modules imported on
the way (the schedule, the config, the data loader), so changing those re-ran nothing. The imports are read from
the source with `ast`, at the top of a module and inside its functions alike (a lazy import runs too), as
tests/layering.py reads them to check the layers; importing a module also runs its packages' `__init__.py`, so
those count. A module named only in a string (`importlib.import_module`) is not seen: name it as an entry.

The key covers each file's path relative to the repository (never this machine's absolute path) and its bytes,
in sorted order: the same sources give the same key on any machine, whatever the order found or the mtimes."""
from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

from labkit.io import atomic_write_text
from labkit.paths import ROOT

PACKAGE = Path(__file__).resolve().parent  # labkit/


def read_bytes(path: Path) -> bytes:
    """The one place a source is read (tests replace it to change a file without touching it)."""
    return path.read_bytes()


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package at `package`: its name relative to the package ("byhand.runs"; "" for the
    package's own `__init__.py`) -> its file."""
    out = {}
    for f in package.rglob("*.py"):
        name = ".".join(f.relative_to(package).with_suffix("").parts)
        out[name.removesuffix(".__init__") if name != "__init__" else ""] = f
    return out


def package_imports(text: str, mod: str, is_package: bool, known: set[str],
                    pkg_name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of the package `pkg_name` in the source
    `text` of module `mod` (a name relative to the package; `is_package` for an `__init__.py`), also inside
    functions. `from pkg.a import b` gives ("a.b", None) when a.b is one of the `known` modules, else ("a", "b")."""
    here = mod.split(".") + (["_"] if is_package else [])
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == pkg_name or (node.module or "").startswith(pkg_name + "."):
                target = node.module[len(pkg_name) + 1:]
            else:
                continue
            for a in node.names:
                full = f"{target}.{a.name}".strip(".")
                out.append((full, None, node.lineno) if full in known else (target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name[len(pkg_name) + 1:], None, node.lineno) for a in node.names
                    if a.name.startswith(pkg_name + ".")]
    return out


def _with_packages(mod: str, known: dict[str, Path]) -> set[str]:
    """The module and the packages above it (importing a.b.c runs the __init__.py of the package, a and a.b)."""
    parts = mod.split(".") if mod else []
    return {".".join(parts[:i]) for i in range(len(parts) + 1)} & set(known)


def dependencies(*entries: str | Path) -> list[Path]:
    """The entries' files and every file of the package they import, transitively, sorted. An entry is a labkit
    module's dotted name ("labkit.byhand.runs") or the path of a script (bench/plan_calibration.py)."""
    known = modules(PACKAGE)
    names, scripts = set(), []
    for e in entries:
        if isinstance(e, Path):
            scripts.append(e)
        elif e.startswith(PACKAGE.name + ".") and e[len(PACKAGE.name) + 1:] in known:
            names |= _with_packages(e[len(PACKAGE.name) + 1:], known)
        else:
            raise ValueError(f"'{e}' is not a module of {PACKAGE.name}")

    def imported(text: str, mod: str, is_package: bool) -> set[str]:
        found = {t for t, _, _ in package_imports(text, mod, is_package, set(known), PACKAGE.name) if t in known}
        return set().union(*(_with_packages(t, known) for t in found))

    for script in scripts:
        names |= imported(read_bytes(script).decode("utf-8"), "", False)
    todo = sorted(names)
    while todo:
        mod = todo.pop()
        f = known[mod]
        new = imported(read_bytes(f).decode("utf-8"), mod, f.name == "__init__.py") - names
        names |= new
        todo += sorted(new)
    return sorted({known[m] for m in names} | set(scripts))


def _files(path: Path) -> list[Path]:
    """A data file, or a folder's files; never Python's bytecode caches (their headers hold the sources' mtimes)."""
    return [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts] if path.is_dir() else [path]


def source_key(*entries: str | Path, data: Iterable[str | Path] = (), also: Iterable[str] = ()) -> str:
    """sha256 (hex) over `dependencies(*entries)`, the files of `data` (files or folders, relative to the repository
    root or absolute inside it) and the strings `also` (a command line, an environment: whatever else the result
    depends on). Every path is taken relative to the repository root, so a file outside it is a ValueError."""
    files = set(dependencies(*(ROOT / e if isinstance(e, Path) and not e.is_absolute() else e for e in entries)))
    files |= {f for d in data for f in _files(ROOT / d)}
    h = hashlib.sha256()
    for name, f in sorted((f.resolve().relative_to(ROOT).as_posix(), f) for f in files):
        h.update(f"{name}\0{hashlib.sha256(read_bytes(f)).hexdigest()}\n".encode())
    for text in also:
        h.update(f"also\0{text}\n".encode())
    return h.hexdigest()


def stamp(path: str | Path, key: str) -> None:
    """Record `key` in `path` (written whole or not at all): the cache beside it was made from these sources."""
    atomic_write_text(path, key + "\n")


def stamped(path: str | Path, key: str) -> bool:
    """True when `path` holds `key`: the cache it stamps was made from today's sources (False when absent)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip() == key
    except (FileNotFoundError, UnicodeDecodeError):
        return False
