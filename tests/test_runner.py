"""`labkit run` on small throwaway notebooks: parameters go only where declared, --only, --keep-going, a failing
notebook reported by file and cell, figures on the summary page."""
import json
import re

import nbformat
import pytest

from labkit.course import runner
from labkit.errors import LabkitError

pytestmark = pytest.mark.slow  # `make check` leaves this file out (see pyproject.toml's markers)


def notebook(path, params: str | None, *cells: str):
    nb = nbformat.v4.new_notebook()
    if params is not None:
        nb.cells.append(nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]}))
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    nbformat.write(nb, str(path))


RECORD = "from labkit.course import nb\nimport os\nnb.record('steps', steps)\nnb.record('caller', os.environ.get('LABKIT_CALLER_CWD'))"


@pytest.fixture
def books(tmp_path, monkeypatch):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook(folder / "00_first.ipynb", "steps = 1  # steps\nname = 'a'  # a name", RECORD)
    notebook(folder / "01_plain.ipynb", None, "x = 1")
    notebook(folder / "02_other.ipynb", "lr = 0.1  # learning rate", "from labkit.course import nb\nnb.record('lr', lr)")
    notebook(folder / "03_fails.ipynb", "steps = 1  # steps", "y = 2", "raise ValueError('boom')")
    monkeypatch.setattr(runner, "NOTEBOOKS", folder)
    return folder


def test_only_selects_by_number_or_name(books):
    assert [p.name for p in runner.course_notebooks(["2", "00_first"])] == ["00_first.ipynb", "02_other.ipynb"]
    with pytest.raises(LabkitError) as e:
        runner.course_notebooks(["09"])
    assert "--only 09" in e.value.what and "00, 01, 02, 03" in e.value.fix


def test_a_notebook_in_parts_is_selected_by_its_number_or_part(tmp_path, monkeypatch):
    for name in ("05_dp", "06a_tp", "06b_pp", "06c_plan", "07_run"):
        notebook(tmp_path / f"{name}.ipynb", None, "x = 1")
    (tmp_path / "notes.ipynb").write_text("{}")  # not a course notebook: no number
    monkeypatch.setattr(runner, "NOTEBOOKS", tmp_path)
    names = lambda only: [p.name[:3] for p in runner.course_notebooks(only)]  # noqa: E731
    assert names(None) == ["05_", "06a", "06b", "06c", "07_"]
    assert names(["6"]) == names(["06"]) == ["06a", "06b", "06c"]
    assert names(["06b", "5"]) == ["05_", "06b"]
    assert names(["06c"]) == names(["06c_plan"]) == ["06c"]
    with pytest.raises(LabkitError) as e:
        runner.course_notebooks(["06d"])
    assert "05, 06a, 06b, 06c, 07" in e.value.fix


def test_params_file_must_be_flat(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("steps: 3\ntrain: {lr: 1}\n")
    with pytest.raises(LabkitError) as e:
        runner.read_params(str(f))
    assert "'train' holds a mapping" in e.value.what
    f.write_text("steps: 3\nlr: 0.5\n")
    assert runner.read_params(str(f)) == {"steps": 3, "lr": 0.5}


def test_parameters_go_only_where_declared(books, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logs = []
    out, results = runner.run_notebooks({"steps": 7, "unknown": 1}, only=["00", "01", "02"],
                                        output=str(tmp_path / "run"), log=logs.append)
    by = {r.notebook: r for r in results}
    assert [r.status for r in results] == ["ok", "ok", "ok"]
    assert by["00_first.ipynb"].parameters == {"steps": 7} and by["01_plain.ipynb"].parameters == {}
    assert by["02_other.ipynb"].parameters == {}
    assert by["00_first.ipynb"].figures == {"steps": 7, "caller": str(tmp_path)}  # the caller's folder reaches it
    assert by["02_other.ipynb"].figures == {"lr": 0.1}  # its own default
    assert any("unknown" in m and "ignored" in m for m in logs)
    assert any(m.startswith("▶ 00_first.ipynb") and "steps" in m for m in logs)  # per-notebook progress
    summary = (out / "summary.md").read_text()
    assert "[00_first.ipynb](00_first.ipynb)" in summary and "steps: 7" in summary
    data = json.loads((out / "summary.json").read_text())
    assert data["parameters"] == {"steps": 7, "unknown": 1} and len(data["notebooks"]) == 3
    executed = json.loads((out / "00_first.ipynb").read_text())
    assert any("injected-parameters" in c["metadata"].get("tags", []) for c in executed["cells"])


def test_failure_is_reported_by_file_and_cell_and_stops_unless_keep_going(books, tmp_path):
    books.joinpath("00_first.ipynb").rename(books / "04_first.ipynb")  # a notebook after the failing one
    for keep_going in (False, True):
        out, results = runner.run_notebooks({}, only=["03", "04"], output=str(tmp_path / f"run{keep_going}"),
                                            keep_going=keep_going, log=lambda m: None)
        failed, after = results
        assert failed.status == "failed"
        assert failed.error.startswith("notebooks/03_fails.ipynb: cell 2") and "ValueError: boom" in failed.error
        assert after.status == ("ok" if keep_going else "skipped")
        assert "ValueError: boom" in (out / "summary.md").read_text()


def test_cli_prints_one_json_object_and_fails_with_1(books, tmp_path, capfd):
    from labkit.cli import main

    code = main(["run", "--only", "03", "--output", str(tmp_path / "cli"), "--json"])
    out = capfd.readouterr().out.strip().splitlines()
    assert code == 1 and len(out) == 1
    data = json.loads(out[0])
    assert data["ok"] is False and data["notebooks"][0]["status"] == "failed"


def test_reading_time_counts_one_language_and_the_code(tmp_path):
    from labkit.course.runner import reading_minutes

    md = "中" * 600 + "\n" + "word " * 400  # 600 Chinese characters = 2 min; the English twin is not read twice
    code = "\n".join(["# a comment is not counted"] + [f"x{i} = {i}" for i in range(30)])  # 30 lines = 2 min
    book = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": md},
                      {"cell_type": "code", "metadata": {}, "source": code, "outputs": [], "execution_count": None}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(book), encoding="utf-8")
    assert reading_minutes(path) == 4.0


def test_every_notebook_and_the_course_map_state_its_reading_time():
    """Each notebook's header and the README's course map give the reading time the course's own estimate
    computes (to the minute), so a notebook that grows or shrinks cannot keep an old figure."""
    from labkit.paths import ROOT

    course_map = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in runner.course_notebooks():
        expected = round(runner.reading_minutes(path))
        header = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
        stated = re.search(r"\*\*阅读 / Reading\*\*：约 (\d+) 分钟", header)
        assert stated and int(stated[1]) == expected, f"{path.name}: header says {stated and stated[1]}, estimate {expected}"
        row = re.search(rf"\| `{path.stem}` \|.*\| ~(\d+) min \|", course_map)
        assert row and int(row[1]) == expected, f"README course map: {path.stem} {row and row[1]}, estimate {expected}"
    rows = re.findall(r"^\| `(\d\d[a-z]?_\w+)` \|", course_map, flags=re.M)
    assert rows == [p.stem for p in runner.course_notebooks()], "the course map lists exactly the notebooks, in order"
