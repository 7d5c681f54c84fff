"""`labkit run`: execute the course notebooks in order with papermill into one run folder.

Each notebook runs with kernel `python3` in `notebooks/` (as in JupyterLab; `LABKIT_CALLER_CWD` tells it where
`labkit run` was called, so user paths such as `output_dir` stay relative to that), takes the parameters it declares
from `--params FILE.yaml`, and may record key figures with `labkit.course.nb.record`; the run ends with `summary.md` and
`summary.json` linking every executed notebook and listing every seed verdict (`nb.verdict`) with its measured value
and rule. A failing notebook is reported by file and cell.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.config import read_yaml
from labkit.errors import LabkitError
from labkit.io import atomic_write_text
from labkit.output import add_common_flags, emit
from labkit.paths import NOTEBOOKS, RUNS

FIGURES_ENV = "LABKIT_FIGURES_FILE"
STRICT_EXERCISES_ENV = "LABKIT_STRICT_EXERCISES"  # 1: an exercise check that says "not yet" fails
CALLER_ENV = "LABKIT_CALLER_CWD"  # where `labkit run` was called: notebooks resolve user paths (output_dir) from it


@dataclass
class NotebookResult:
    notebook: str
    output: str
    status: str  # ok | failed | skipped
    seconds: float = 0.0
    reading_minutes: float = 0.0
    parameters: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    verdicts: list = field(default_factory=list)  # every seed verdict: item, quote, measured, rule, verdict, basis
    error: str | None = None


def cell_text(cell: dict) -> str:
    """A notebook cell's source as one string (nbformat stores it as a string or a list of lines)."""
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


READING_RATE = {"zh_chars": 300, "en_words": 200, "code_lines": 15}  # per minute: a learner reads one language


def reading_minutes(notebook: Path) -> float:
    """How long reading a notebook takes, from its length: its Chinese prose at 300 characters a minute (its English
    is the same content, read instead) and its code at 15 lines a minute. An estimate from counted text, stated as such."""

    book = json.loads(Path(notebook).read_text(encoding="utf-8"))
    zh = en = code = 0
    for cell in book["cells"]:
        text = cell_text(cell)
        if cell["cell_type"] == "code":
            code += sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
        else:
            zh += len(re.findall(r"[\u4e00-\u9fff]", text))
            en += len(re.findall(r"[A-Za-z]+", text))
    prose = zh / READING_RATE["zh_chars"] if zh else en / READING_RATE["en_words"]
    return round(prose + code / READING_RATE["code_lines"], 1)


COURSE_NAME = re.compile(r"(\d\d)([a-z]?)_\w+\.ipynb")  # 03_data_pipeline, 06a_...: a number, a part letter, a name


def _selects(key: str, name: str) -> bool:
    """"6" or "06" selects every part of notebook 06, "06b" that part."""
    wanted, have = re.fullmatch(r"(\d+)([a-z]?)", key), COURSE_NAME.fullmatch(name)
    return bool(wanted) and wanted[1].zfill(2) == have[1] and wanted[2] in ("", have[2])


def course_notebooks(only: list[str] | None = None) -> list[Path]:
    """The notebooks in order; `only` selects by number ("04", "6": every part of 06) or part ("06a") or name."""
    books = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if COURSE_NAME.fullmatch(p.name))
    if not only:
        return books
    picked = []
    for key in only:
        match = [p for p in books if p.stem == key or p.name == key or _selects(key, p.name)]
        if not match:
            raise LabkitError(f"--only {key}: no notebook matches",
                              f"choose from {', '.join(p.name.split('_')[0] for p in books)}")
        picked += [m for m in match if m not in picked]
    return sorted(picked)


def read_params(path: str | None) -> dict:
    if not path:
        return {}

    params = read_yaml(path)
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise LabkitError(f"{path}: parameters must be a flat mapping; {nested[0]!r} holds a mapping",
                          "write one `name: value` per line, e.g. `steps: 20`")
    return params


def declared_parameters(notebook: Path) -> dict:
    import papermill

    return papermill.inspect_notebook(str(notebook))


def _describe_failure(exc: Exception, notebook: Path) -> str:
    cell = getattr(exc, "cell_index", None)
    count = getattr(exc, "exec_count", None)
    ename, evalue = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    where = f"cell {cell}" if cell is not None else "a cell"
    if count is not None:
        where += f" (In [{count}])"
    return f"{notebook.relative_to(NOTEBOOKS.parent)}: {where}: {ename}: {evalue}"


def run_notebooks(params: dict | None = None, only: list[str] | None = None, output: str | None = None,
                  keep_going: bool = False, log=print) -> tuple[Path, list[NotebookResult]]:
    import papermill

    params = params or {}
    books = course_notebooks(only)
    if not books:
        raise LabkitError(f"no notebooks found in {NOTEBOOKS}")
    caller = os.getcwd()
    out_dir = Path(output) if output else RUNS / time.strftime("run-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    unused = set(params)
    results: list[NotebookResult] = []
    failed = False
    for nb in books:
        target = out_dir / nb.name
        declared = declared_parameters(nb)
        mine = {k: v for k, v in params.items() if k in declared}
        unused -= set(mine)
        if failed and not keep_going:
            results.append(NotebookResult(nb.name, str(target), "skipped", parameters=mine))
            continue
        figures_file = out_dir / f"{nb.stem}.figures.json"
        figures_file.unlink(missing_ok=True)
        os.environ[FIGURES_ENV] = str(figures_file.resolve())
        os.environ[CALLER_ENV] = caller
        os.environ.setdefault(STRICT_EXERCISES_ENV, "1")  # the shipped solutions must solve their exercises
        log(f"▶ {nb.name}" + (f"  parameters: {mine}" if mine else ""))
        start = time.time()
        res = NotebookResult(nb.name, str(target), "ok", parameters=mine, reading_minutes=reading_minutes(nb))
        try:
            papermill.execute_notebook(str(nb), str(target), parameters=mine, kernel_name="python3",
                                       cwd=str(NOTEBOOKS), progress_bar=True, log_output=False,
                                       stdout_file=None, stderr_file=None, kernel_manager_class=ipc_kernel_manager())
        except papermill.PapermillExecutionError as e:
            res.status, res.error, failed = "failed", _describe_failure(e, nb), True
            log(f"✗ {res.error}")
        finally:
            os.environ.pop(FIGURES_ENV, None)
            os.environ.pop(CALLER_ENV, None)
        res.seconds = round(time.time() - start, 1)
        if figures_file.exists():
            res.figures = json.loads(figures_file.read_text(encoding="utf-8"))
            res.verdicts = res.figures.pop("verdicts", [])
        results.append(res)
    if unused:
        log(f"note: no notebook declares {sorted(unused)} (ignored)")
    write_summary(out_dir, results, params)
    return out_dir, results


def write_summary(out_dir: Path, results: list[NotebookResult], params: dict) -> None:
    lines = ["# Run summary / 运行摘要", "", f"- parameters: `{json.dumps(params, ensure_ascii=False)}`", "",
             "| notebook | status | seconds | reading (min, estimated) | key figures |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        figs = ", ".join(f"{k}: {v}" for k, v in r.figures.items()) or ("—" if not r.error else r.error)
        lines.append(f"| [{r.notebook}]({r.notebook}) | {r.status} | {r.seconds} | {r.reading_minutes} | {figs} |")
    lines += verdict_lines(results)
    atomic_write_text(out_dir / "summary.md", "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "summary.json",
                      json.dumps({"parameters": params, "notebooks": [asdict(r) for r in results]}, indent=2,
                                 ensure_ascii=False, default=str))


def verdict_lines(results: list[NotebookResult]) -> list[str]:
    """summary.md's table of every seed verdict: the measured value and the rule beside the verdict, so a reader can
    disagree with a threshold."""
    rows = [(r.notebook, v) for r in results for v in r.verdicts]
    if not rows:
        return []
    out = ["", "## 种子文章的结论 / The seeds' claims judged", "",
           "| notebook | # | section | seed's words | claim | measured | rule | verdict | basis | figure |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for notebook, v in rows:
        cells = [notebook, v["seed item"], v["section"], v["quote"], v["claim"], v["measured"], v["rule"],
                 v["verdict"], v["basis"], v["figure"]]
        out.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return out


def add_cli(parser) -> None:
    parser.add_argument("--params", help="YAML file: a flat mapping of notebook parameters (applied where declared)")
    parser.add_argument("--only", nargs="+", metavar="NN", help="run only these notebooks (e.g. --only 00 04)")
    parser.add_argument("--output", help="run folder (default: runs/run-<timestamp>)")
    parser.add_argument("--keep-going", action="store_true", help="run the remaining notebooks after a failure")
    add_common_flags(parser, "print one JSON object")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    params = read_params(args.params)
    out_dir, results = run_notebooks(params, args.only, args.output, args.keep_going,
                                     log=lambda m: print(m, file=sys.stderr))
    failed = [r for r in results if r.status == "failed"]
    text = "\n".join([f"{r.status:>7}  {r.notebook}  ({r.seconds}s)" for r in results] +
                     [f"executed notebooks: {out_dir}/", f"summary: {out_dir / 'summary.md'}"])
    emit(args, {"ok": not failed, "output": str(out_dir), "summary": str(out_dir / "summary.md"),
                "notebooks": [asdict(r) for r in results]}, text)
    for r in failed:
        print(f"labkit run: failed: {r.error}\n  see the executed notebook {r.output}", file=sys.stderr)
    return 1 if failed else 0


def ipc_kernel_manager():
    """Kernels on local IPC sockets instead of TCP ports: the same kernel, and none of ipykernel's warnings about
    plain-text TCP, which a learner cannot act on."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(transport="ipc", **kwargs)

    return IPCKernelManager
