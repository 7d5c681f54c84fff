"""Strict exercises prove each check can fail: it rejects the emptied solution and the tool's own answer."""
import json
import subprocess
import sys
import textwrap

import pytest

from labkit.course import nb as nb_module
from labkit.course.runner import course_notebooks
from labkit.course.student import CHECK_TAG, SOLUTION_TAG, tags

SOLUTION = "import math as m\nfrom os import path\ny, (z, *rest) = 1, (2, 3)\nfor i in range(2):\n    w = i\n" \
           "def f():\n    inner = 1\n"


def _namespace():
    ns = {"__builtins__": __builtins__, "kept": object()}
    exec(SOLUTION, ns)
    return ns


def _check(ns, source):
    return eval(source, ns)


def test_bound_names_are_the_top_level_bindings():
    assert nb_module._bound_names(SOLUTION) == ["m", "path", "y", "z", "rest", "i", "w", "f"]


def test_a_check_that_needs_the_solution_passes():
    ns = _namespace()
    assert nb_module._prove_check_can_fail(_check(ns, "lambda: y == 1 and w == 1"), SOLUTION) is None


def test_a_check_passing_on_a_missing_name_is_caught():
    ns = _namespace()
    verify = _check(ns, "lambda: 'y' not in globals() or y == 1")
    assert verify()
    assert nb_module._prove_check_can_fail(verify, SOLUTION) == "the check accepts an emptied solution"


def test_a_check_accepting_the_tools_answer_is_caught():
    ns = _namespace()
    verify = _check(ns, "lambda: y == 1")
    assert nb_module._prove_check_can_fail(verify, SOLUTION, lambda: {"y": 2}) is None
    assert nb_module._prove_check_can_fail(verify, SOLUTION, lambda: {"y": 1}) == \
        "the check accepts the tool's own answer"


@pytest.mark.parametrize("body", ["lambda: y == 1", "lambda: 1 / 0", "lambda: exec('y = 99', globals()) or 1 / 0"])
def test_the_namespace_is_restored_exactly(body):
    ns = _namespace()
    before = dict(ns)
    nb_module._prove_check_can_fail(_check(ns, body), SOLUTION, lambda: {"y": 5, "new_name": 7})
    assert ns.keys() == before.keys()
    assert all(ns[k] is before[k] for k in before)


def test_strict_mode_raises_naming_the_exercise_and_the_proof(monkeypatch):
    ns = _namespace()
    monkeypatch.setenv(nb_module.STRICT_EXERCISES_ENV, "1")
    monkeypatch.setattr(nb_module, "_solution_source", lambda: SOLUTION)
    with pytest.raises(AssertionError, match="exercise t.9: the check accepts an emptied solution"):
        nb_module.exercise("t.9", _check(ns, "lambda: True"), "-")
    with pytest.raises(AssertionError, match="exercise t.9: the check accepts the tool's own answer"):
        nb_module.exercise("t.9", _check(ns, "lambda: y == 1"), "-", tool_answer=lambda: {"y": 1})
    assert nb_module.exercise("t.9", _check(ns, "lambda: y == 1"), "-", tool_answer=lambda: {"y": 0})


def test_outside_ipython_no_proof_runs(monkeypatch):
    monkeypatch.setenv(nb_module.STRICT_EXERCISES_ENV, "1")
    assert nb_module._solution_source() is None
    assert nb_module.exercise("t.10", lambda: True, "-")


def test_every_check_cell_follows_its_solution_cell():
    """The proof takes the cell run just before the check as the solution: the notebooks keep them adjacent."""
    for path in course_notebooks():
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if CHECK_TAG in tags(cell):
                assert i and SOLUTION_TAG in tags(cells[i - 1]), f"{path.name} cell {i}: no solution cell just above"


def test_in_a_shell_the_cell_run_before_the_check_is_the_solution(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv(nb_module.STRICT_EXERCISES_ENV, "1")
    monkeypatch.setattr(nb_module, "_CELLS", [])
    shell = InteractiveShell.instance()
    try:
        nb_module._watch_cells()
        shell.user_ns["nb"] = nb_module
        for source, caught in (("y = 1", None), ("nb.exercise('k.1', lambda: y == 1, '-')", None),
                               ("y = 1", None),
                               ("nb.exercise('k.2', lambda: 'y' not in globals() or y == 1, '-')", "emptied")):
            error = shell.run_cell(source, store_history=False).error_in_exec
            assert (error is None) if caught is None else caught in str(error)
        assert shell.user_ns["y"] == 1
    finally:
        InteractiveShell.clear_instance()


def test_importing_nb_registers_nothing_and_setup_registers_the_watcher_once(tmp_path):
    """In a fresh process with a shell, strict mode on: the import adds no IPython hook; `setup` adds the cell
    watcher, and a second `setup` (a re-run first cell) does not add it again."""
    script = textwrap.dedent(f"""
        import os
        from IPython.core.interactiveshell import InteractiveShell
        os.environ["{nb_module.STRICT_EXERCISES_ENV}"] = "1"
        hooks = InteractiveShell.instance().events.callbacks["pre_run_cell"]
        before = list(hooks)
        from labkit.course import nb
        assert hooks == before, hooks
        nb.setup("t", output_dir={str(tmp_path)!r})
        nb.setup("t", output_dir={str(tmp_path)!r})
        assert hooks == [*before, nb._remember], hooks
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_notebook_sets_up_before_its_first_exercise():
    """The strict proofs' cell watcher starts in `nb.setup`: a notebook with exercises calls it first."""
    for path in course_notebooks():
        code = ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                if c["cell_type"] == "code"]
        first = next((i for i, c in enumerate(code) if "nb.exercise(" in c), None)
        if first is not None:
            assert any("nb.setup(" in c for c in code[:first]), f"{path.name}: no nb.setup before the first exercise"
