"""A cache's key (labkit.sources) changes exactly when something its result was made from changes: a module the
entry imports, even indirectly or inside a function, changes it; a module it never imports does not; neither do
mtimes, the checkout's location or the order files are found in."""
import os
import shutil
import textwrap

import pytest

from labkit import sources
from labkit.course import parallel_lab

LAYOUTS = "labkit.byhand.runs"  # the parallel layouts' worker, what parallel_lab's cache holds results of


def _changed(monkeypatch, relative: str):
    """Make the reader see `relative` (a path under the repository) with one more line; the file is untouched."""
    read = sources.read_bytes
    target = (sources.ROOT / relative).resolve()
    monkeypatch.setattr(sources, "read_bytes", lambda p: read(p) + (b"\n# edited\n" if p.resolve() == target else b""))


def test_a_module_imported_only_indirectly_changes_the_key(monkeypatch):
    text = (sources.PACKAGE / "byhand/runs.py").read_text(encoding="utf-8")
    direct = {t for t, _, _ in sources.package_imports(text, "byhand.runs", False, set(sources.modules(
        sources.PACKAGE)), "labkit")}
    assert "training.schedule" not in direct, "the test wants a module the worker does not import itself"
    before, launch = sources.source_key(LAYOUTS), parallel_lab.launch_key(["worker"], 2)
    _changed(monkeypatch, "labkit/training/schedule.py")
    assert sources.source_key(LAYOUTS) != before
    assert parallel_lab.launch_key(["worker"], 2) != launch


def test_an_unrelated_module_leaves_the_key_alone(monkeypatch):
    before, launch = sources.source_key(LAYOUTS), parallel_lab.launch_key(["worker"], 2)
    _changed(monkeypatch, "labkit/course/widgets.py")
    assert sources.source_key(LAYOUTS) == before
    assert parallel_lab.launch_key(["worker"], 2) == launch


def test_a_named_data_file_and_the_launch_arguments_change_the_key(monkeypatch):
    before = parallel_lab.launch_key(["worker"], 2)
    assert parallel_lab.launch_key(["memory", "--only", "tp2"], 2) != before
    assert parallel_lab.launch_key(["worker"], 4) != before
    _changed(monkeypatch, "data/tokenizer/tokenizer.json")
    assert parallel_lab.launch_key(["worker"], 2) != before


def _copy(tmp_path, monkeypatch):
    """The package copied to another folder, every file's mtime moved, its modules found in reverse order: what
    `sources` reads from now on."""
    root = tmp_path / "checkout"
    shutil.copytree(sources.PACKAGE, root / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    for f in (root / "labkit").rglob("*"):
        os.utime(f, (1_000_000, 1_000_000))
    found = sources.modules
    monkeypatch.setattr(sources, "modules", lambda pkg: dict(reversed(list(found(pkg).items()))))
    monkeypatch.setattr(sources, "ROOT", root)
    monkeypatch.setattr(sources, "PACKAGE", root / "labkit")
    return root


def test_neither_mtimes_nor_location_nor_order_matter(tmp_path, monkeypatch):
    here = sources.source_key(LAYOUTS)
    _copy(tmp_path, monkeypatch)
    assert sources.source_key(LAYOUTS) == here


def test_imports_inside_functions_and_packages_count(tmp_path, monkeypatch):
    copy = _copy(tmp_path, monkeypatch)
    (copy / "labkit/lazy.py").write_text(textwrap.dedent("""\
        def f():
            from labkit.training import schedule  # lazy
            return schedule
        """))
    deps = {p.relative_to(copy).as_posix() for p in sources.dependencies("labkit.lazy")}
    assert {"labkit/lazy.py", "labkit/__init__.py", "labkit/training/__init__.py",
            "labkit/training/schedule.py"} <= deps
    before = sources.source_key("labkit.lazy")
    (copy / "labkit/training/schedule.py").write_text("# another schedule\n")
    assert sources.source_key("labkit.lazy") != before


def test_a_data_folder_counts_its_files_not_bytecode(tmp_path, monkeypatch):
    root = _copy(tmp_path, monkeypatch)
    before = sources.source_key(data=["labkit/model/kernels"])
    (root / "labkit/model/kernels/__pycache__").mkdir(exist_ok=True)
    (root / "labkit/model/kernels/__pycache__/build.cpython-311.pyc").write_bytes(b"any mtime")
    assert sources.source_key(data=["labkit/model/kernels"]) == before
    (root / "labkit/model/kernels/rmsnorm.cc").write_text("// another kernel\n")
    assert sources.source_key(data=["labkit/model/kernels"]) != before


def test_a_name_that_is_no_module_is_refused():
    with pytest.raises(ValueError, match="not a module"):
        sources.dependencies("labkit.nowhere")


def test_a_stamp_holds_its_key(tmp_path):
    path = tmp_path / "DONE"
    assert not sources.stamped(path, "k1")
    sources.stamp(path, "k1")
    assert sources.stamped(path, "k1") and not sources.stamped(path, "k2")
