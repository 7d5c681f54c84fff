"""`labkit student`: solutions emptied down to their hint, outputs cleared, check cells kept and answering
"not yet" (never an exception) when the exercise is not solved; the course notebooks themselves untouched."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.course import nb as nb_module
from labkit.course.runner import course_notebooks
from labkit.course.student import CHECK_TAG, LINK, SOLUTION_TAG, student_notebook, tags
from labkit.errors import LabkitError
from labkit.paths import NOTEBOOKS


def _cell(kind, source, tag=None, outputs=True):
    cell = {"cell_type": kind, "metadata": {"tags": [tag]} if tag else {}, "source": source}
    if kind == "code":
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x"}] if outputs else []
        cell["execution_count"] = 3
    return cell


def test_solution_keeps_only_its_hint_and_outputs_go():
    book = {"cells": [_cell("markdown", "## 练习 / Exercises"),
                      _cell("code", "# hint: double it\n# 提示：乘二\nanswer = 2 * 21\n", SOLUTION_TAG),
                      _cell("code", "nb.exercise('x.1', lambda: answer == 42, 'double 21')", CHECK_TAG)]}
    copy, emptied = student_notebook(book)
    assert emptied == 1
    assert "answer = 2 * 21" not in copy["cells"][1]["source"]
    assert copy["cells"][1]["source"].startswith("# hint: double it\n# 提示：乘二\n")
    assert copy["cells"][2]["source"] == book["cells"][2]["source"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in copy["cells"] if c["cell_type"] == "code")
    assert book["cells"][1]["outputs"], "the original is not modified"


def test_exercise_says_not_yet_and_is_strict_only_when_asked(monkeypatch, capsys):
    monkeypatch.delenv(nb_module.STRICT_EXERCISES_ENV, raising=False)
    assert nb_module.exercise("t.1", lambda: undefined_name, "define it") is False  # noqa: F821
    out = capsys.readouterr().out
    assert "not yet (NameError" in out and "define it" in out
    assert nb_module.exercise("t.2", lambda: 1 + 1 == 2, "-") is True
    monkeypatch.setenv(nb_module.STRICT_EXERCISES_ENV, "1")
    with pytest.raises(AssertionError, match="exercise t.3: not yet"):
        nb_module.exercise("t.3", lambda: False, "wrong on purpose")


def test_refuses_to_write_over_the_course(tmp_path):
    from labkit.course.student import write_student_copies

    with pytest.raises(LabkitError, match="would replace the course notebooks"):
        write_student_copies(NOTEBOOKS)


def links_outside(folder: Path) -> list[str]:
    """Relative links of the notebooks and documents under `folder` whose target is not a file under `folder`."""
    broken = []
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".ipynb":
            texts = ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                     if c["cell_type"] == "markdown"]
        elif path.suffix == ".md":
            texts = [path.read_text(encoding="utf-8")]
        else:
            continue
        for m in (m for t in texts for m in LINK.finditer(t) if "://" not in m[1]):
            target = (path.parent / m[1]).resolve()
            if not (target.is_file() and target.is_relative_to(folder.resolve())):
                broken.append(f"{path.relative_to(folder)}: {m[1]}")
    return broken


def test_student_copies_of_the_course(tmp_path, monkeypatch):
    out = tmp_path / "any" / "depth" / "student"  # copies work from any folder, not only two levels under the lab
    r = subprocess.run([sys.executable, "-m", "labkit", "student", "--output", str(out), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    originals = sorted(course_notebooks())
    assert sorted(report["notebooks"]) == [p.name for p in originals]
    # the course's own links leave notebooks/ (the README's course map, a test file); in the copies each still opens
    assert any("](../README.md" in "".join(c["source"]) for p in originals
               for c in json.loads(p.read_text(encoding="utf-8"))["cells"])
    assert "lab/README.md" in report["documents"]
    assert links_outside(out) == []
    monkeypatch.delenv(nb_module.STRICT_EXERCISES_ENV, raising=False)
    for original in originals:
        book = json.loads(original.read_text(encoding="utf-8"))
        copy = json.loads((out / original.name).read_text(encoding="utf-8"))
        solutions = [c for c in book["cells"] if SOLUTION_TAG in tags(c)]
        checks = [c for c in copy["cells"] if CHECK_TAG in tags(c)]
        assert solutions and checks, f"{original.name}: every notebook has exercises with a solution and a check"
        assert report["notebooks"][original.name] == {"solutions_emptied": len(solutions), "checks": len(checks)}
        # alone, each check answers "not yet" and does not raise; that it rejects an emptied solution in the
        # notebook's own namespace is proved in every strict run (nb._prove_check_can_fail, tests/test_exercise.py)
        for cell in checks:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec("".join(cell["source"]), {"nb": nb_module})
            assert "not yet" in buf.getvalue(), f"{original.name}: {''.join(cell['source'])[:80]}"


