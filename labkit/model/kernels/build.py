"""Compile the lab's C++ kernels on first use, into a cache that never hands a binary to another CPU.

A kernel is built with `g++ -O3 -march=native -fopenmp-simd -fno-math-errno -shared -fPIC` (MindSpore's own
auto-compile of a `.cc` path passes no `-O` flag, and an unoptimised kernel loses most of the gain; without
-fno-math-errno a `std::sqrt` is a branch around a libm call and its loop does not vectorise). `-march=native` code
may use instructions another CPU lacks (AVX-512 on one machine, AVX2 on the next), so the cache folder is keyed by
the source text and every header beside it (`#include "fast_exp.h"`: an edited header is a new build, never a stale
binary), the compiler's version, the flags and this CPU's model name and feature flags: a copied `runs/`
folder or a shared file system makes a new build instead of crashing with an illegal instruction.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from labkit.errors import LabkitFailure
from labkit.paths import RUNS

SOURCES = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")
CACHE = RUNS / "cache" / "kernels"


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ or c++ on PATH, else None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def switch_cells(model, op, what: str, matches, cls, attach, log=None) -> int:
    """Give every cell of `model` for which `matches(cell)` holds the class `cls` (a subclass whose construct calls
    the custom operator `op`), after `attach(cell)` has set what that construct needs; returns how many. When `op`
    is None (no C++ compiler) nothing changes and one line says that `what` runs MindSpore's native operators."""
    if op is None:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"kernels: no C++ compiler found (g++/c++ or $CXX); {what} runs MindSpore's native operators")
        return 0
    n = 0
    for _, cell in model.cells_and_names():
        if matches(cell):
            attach(cell)
            cell.__class__ = cls
            n += 1
    return n


def cpu_identity() -> str:
    """This CPU's model name and feature flags (from /proc/cpuinfo; the platform string elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
            if ln.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))  # one copy of each line (every core repeats them)


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.strip()


def headers(source: Path) -> list[Path]:
    """The headers a kernel may include: every `*.h` in its folder (all of them, not a parse of the #include
    lines: a header including another is covered too), sorted by name."""
    return sorted(source.parent.glob("*.h"))


def cache_key(source: Path, cxx: str) -> str:
    h = hashlib.sha256()
    texts = [source.read_bytes()]
    for header in headers(source):
        texts += [header.name.encode(), header.read_bytes()]
    for part in (*texts, compiler_version(cxx).encode(), " ".join(FLAGS).encode(), cpu_identity().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(name: str, cache: Path | None = None) -> Path | None:
    """Path of the shared library for `labkit/model/kernels/<name>.cc`, compiled if not cached; None when no
    C++ compiler is found. A failed compilation raises LabkitFailure with the compiler's message."""
    cxx = compiler()
    if cxx is None:
        return None
    source = SOURCES / f"{name}.cc"
    folder = Path(cache or CACHE) / cache_key(source, cxx)
    lib = folder / f"{name}.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)  # build beside, then rename: readers never see half a file
    os.close(fd)
    try:
        p = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise LabkitFailure(f"compiling {source} failed:\n{p.stderr.strip()[-2000:]}",
                                "set train.kernels: native, or fix the compiler (CXX=...)")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    (folder / "built_for.txt").write_text(f"{compiler_version(cxx)}\n{' '.join(FLAGS)}\n{cpu_identity()}\n",
                                          encoding="utf-8")
    return lib
