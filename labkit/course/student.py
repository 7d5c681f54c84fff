"""`labkit student --output DIR`: the notebooks as a workshop hands them out.

In a student copy every cell tagged `solution` keeps only its leading comment lines (the hint) and a line saying
where the answer goes; every output and execution count is cleared; the `exercise-check` cells stay as they are,
so running one before the exercise is solved prints "not yet" and a hint instead of failing
(`labkit.course.nb.exercise`). Copies run from any folder: the notebooks find the lab through `labkit.paths`, and
the documents their links lead to outside `notebooks/` (the README's course map, docs/, a test file) are copied under
`lab/` in the output folder with every relative link rewritten, so that each link opens in JupyterLab, whose file
browser cannot leave the folder it was started in.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from labkit.course.runner import cell_text, course_notebooks
from labkit.errors import LabkitError
from labkit.io import atomic_dir
from labkit.output import add_common_flags, emit
from labkit.paths import NOTEBOOKS, ROOT

SOLUTION_TAG = "solution"
CHECK_TAG = "exercise-check"
PLACEHOLDER = "# 在这里写你的答案 / write your answer here\n"
DOCS = "lab"  # the folder of the output that holds the lab's documents the notebooks link to
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")  # a markdown link's relative target and its anchor


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def hint_of(source: str) -> str:
    """The leading comment lines of a solution cell: what a learner may see before solving it."""
    lines = []
    for line in source.splitlines(keepends=True):
        if not line.lstrip().startswith("#"):
            break
        lines.append(line if line.endswith("\n") else line + "\n")
    return "".join(lines)


def _place(target: Path) -> Path:
    """Where the lab's file `target` sits in the output folder, relative to it."""
    if target.parent == NOTEBOOKS.resolve() and target.suffix == ".ipynb":
        return Path(target.name)
    return Path(DOCS) / target.relative_to(ROOT.resolve())


def relink(text: str, source: Path, linked: set[Path]) -> str:
    """`text` (markdown of the lab's file `source`) with every relative link pointing where the output folder holds its
    target; each target outside the notebooks is added to `linked` (to be copied)."""
    def one(m: re.Match) -> str:
        target = (source.parent / m[1]).resolve()
        if "://" in m[1] or m[1].startswith("mailto:") or not target.is_relative_to(ROOT.resolve()):
            return m[0]
        if not target.exists():
            raise LabkitError(f"{source.relative_to(ROOT)} links to {m[1]}, which does not exist",
                              "fix the link in the course before writing student copies")
        if _place(target).parts[0] == DOCS:
            linked.add(target)
        here = _place(source.resolve()).parent
        return f"]({Path(os.path.relpath(_place(target), here)).as_posix()}{m[2] or ''})"
    return LINK.sub(one, text)


def copy_linked(tmp: Path, linked: set[Path]) -> list[str]:
    """Copy the documents the notebooks link to (and those they link to in turn) under tmp/lab, links rewritten."""
    done: set[Path] = set()
    while linked - done:
        target = sorted(linked - done)[0]
        done.add(target)
        dst = tmp / _place(target)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".md":
            dst.write_text(relink(target.read_text(encoding="utf-8"), target, linked), encoding="utf-8")
        else:
            shutil.copyfile(target, dst)
    return sorted(str(_place(t)) for t in done)


def student_notebook(book: dict, source: Path | None = None, linked: set[Path] | None = None) -> tuple[dict, int]:
    """A copy of one notebook (nbformat JSON) with the solutions emptied; returns it and how many were emptied.
    With `source` (the notebook's path), its markdown links are rewritten for the output folder (`relink`)."""
    out = json.loads(json.dumps(book))
    emptied = 0
    for cell in out["cells"]:
        if cell["cell_type"] == "markdown" and source is not None:
            cell["source"] = relink(cell_text(cell), source, linked if linked is not None else set())
        if cell["cell_type"] != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        if SOLUTION_TAG in tags(cell):
            cell["source"] = hint_of(cell_text(cell)) + PLACEHOLDER
            emptied += 1
    return out, emptied


def write_student_copies(output: str | Path, overwrite: bool = False) -> dict:
    output = Path(output).resolve()
    if output == NOTEBOOKS.resolve() or NOTEBOOKS.resolve().is_relative_to(output):
        raise LabkitError(f"--output {output}: the student copies would replace the course notebooks",
                          "choose a folder outside notebooks/, e.g. --output runs/student")
    books = course_notebooks()
    if not books:
        raise LabkitError(f"no notebooks found in {NOTEBOOKS}")
    written, linked = {}, set()
    with atomic_dir(output, overwrite=overwrite) as tmp:
        for nb in books:
            copy, emptied = student_notebook(json.loads(nb.read_text(encoding="utf-8")), nb.resolve(), linked)
            checks = sum(CHECK_TAG in tags(c) for c in copy["cells"])
            (tmp / nb.name).write_text(json.dumps(copy, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            written[nb.name] = {"solutions_emptied": emptied, "checks": checks}
        documents = copy_linked(tmp, linked)
    return {"output": str(output), "notebooks": written, "documents": documents}


def add_cli(parser) -> None:
    parser.add_argument("--output", required=True, help="folder for the student copies (made fresh)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    add_common_flags(parser, "print one JSON object")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    report = write_student_copies(args.output, args.overwrite)
    lines = [f"{name}: {v['solutions_emptied']} solution(s) emptied, {v['checks']} check cell(s) kept"
             for name, v in report["notebooks"].items()]
    lines.append(f"{len(report['documents'])} linked document(s) under {DOCS}/: " + ", ".join(report["documents"]))
    emit(args, report, "\n".join(lines + [f"student copies: {report['output']}/"]))
    print("open them with: jupyter lab " + report["output"], file=sys.stderr)
    return 0
