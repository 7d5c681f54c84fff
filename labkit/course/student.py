"""`labkit student --output DIR`: the notebooks as a workshop hands them out.

In a student copy every cell tagged `solution` keeps only its leading comment lines (the hint) and a line saying
where the answer goes; every output and execution count is cleared; the `exercise-check` cells stay as they are,
so running one before the exercise is solved prints "not yet" and a hint instead of failing
(`labkit.course.nb.exercise`). Copies run from any folder: the notebooks find the lab through `labkit.paths`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from labkit.errors import LabkitError
from labkit.io import atomic_dir
from labkit.course.runner import cell_text, course_notebooks
from labkit.paths import NOTEBOOKS

SOLUTION_TAG = "solution"
CHECK_TAG = "exercise-check"
PLACEHOLDER = "# 在这里写你的答案 / write your answer here\n"


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


def student_notebook(book: dict) -> tuple[dict, int]:
    """A copy of one notebook (nbformat JSON) with the solutions emptied; returns it and how many were emptied."""
    out = json.loads(json.dumps(book))
    emptied = 0
    for cell in out["cells"]:
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
    written = {}
    with atomic_dir(output, overwrite=overwrite) as tmp:
        for nb in books:
            copy, emptied = student_notebook(json.loads(nb.read_text(encoding="utf-8")))
            checks = sum(CHECK_TAG in tags(c) for c in copy["cells"])
            (tmp / nb.name).write_text(json.dumps(copy, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            written[nb.name] = {"solutions_emptied": emptied, "checks": checks}
    return {"output": str(output), "notebooks": written}


def add_cli(parser) -> None:
    from labkit.output import add_common_flags

    parser.add_argument("--output", required=True, help="folder for the student copies (made fresh)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    add_common_flags(parser, "print one JSON object")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    from labkit.output import emit

    report = write_student_copies(args.output, args.overwrite)
    lines = [f"{name}: {v['solutions_emptied']} solution(s) emptied, {v['checks']} check cell(s) kept"
             for name, v in report["notebooks"].items()]
    emit(args, report, "\n".join(lines + [f"student copies: {report['output']}/"]))
    print("open them with: jupyter lab " + report["output"], file=sys.stderr)
    return 0
