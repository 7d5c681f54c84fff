"""Small helpers every notebook calls first: quiet logs, a run folder, checks that fail loudly."""
from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path

from labkit.course import verdicts
from labkit.course.runner import FIGURES_ENV, STRICT_EXERCISES_ENV
from labkit.io import atomic_write_text
from labkit.paths import RUNS
from labkit.runtime import prepare_process


def setup(name: str, output_dir: str | os.PathLike | None = None, device_target: str = "CPU") -> Path:
    """Prepare the kernel's process for `device_target` (labkit.runtime: quiet logs, MindSpore's launch mode; call
    it before importing MindSpore), make and return the run folder.

    `output_dir=None` gives runs/notebooks/<name> under the lab root, whatever the working directory. In strict
    exercise mode inside a kernel it also starts watching the cells (`_watch_cells`), which the exercise checks'
    proofs read: here, not at import, so importing this module changes nothing."""
    prepare_process(device_target)
    _watch_cells()
    run_dir = Path(output_dir) if output_dir else RUNS / "notebooks" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def headless() -> bool:
    """True under papermill/nbval/CI, where widgets have no front end."""
    return bool(os.environ.get("CI") or os.environ.get("PAPERMILL_INPUT_PATH") or os.environ.get("LABKIT_HEADLESS"))


def check(condition: bool, claim: str) -> None:
    """The 'Check / 验证' cells: print the claim when it holds, fail the notebook when it does not."""
    if not condition:
        raise AssertionError(f"check failed: {claim}")
    print(f"✓ {claim}")


VERDICTS = verdicts.VERDICTS  # every verdict of this kernel, in order: the notebook's summary table is made from it
Band, Threshold, Compare, Outcome, Beyond, Sides = (verdicts.Band, verdicts.Threshold, verdicts.Compare,
                                                   verdicts.Outcome, verdicts.Beyond, verdicts.Sides)
not_testable = verdicts.not_testable


def verdict(item, *legacy, **given) -> None:
    """A seed claim judged in this run: nb.verdict(item, quote=, section=, claim=, measured=, rule=, other_side=,
    figure=, basis=), that is `labkit.course.verdicts.judge` with the seed-coverage `item` number, the seed's sentence
    `quote` (Chinese, exactly) and its `section`, the `measured` value, the `rule` that judges it with the seed's
    number, and (strict mode) a stated `other_side` the rule judges the other way; a claim nothing here can decide is
    `nb.not_testable(...)`. Printed, kept in VERDICTS for `verdict_table()`, recorded for `labkit run`'s summary;
    returns nothing, so a cell that ends with a verdict shows only its lines.

    The old form verdict(item, claim, held, figure, basis) still runs, with a deprecation notice on stderr."""
    if legacy or "held" in given:
        verdicts.legacy(item, *legacy, **given)
        return
    missing = [k for k in ("quote", "section", "claim", "measured", "rule") if k not in given]
    if missing:
        raise TypeError(f"verdict #{item}: give {', '.join(missing)} (or use nb.not_testable)")
    seed = verdicts.Seed(item, given.pop("quote"), given.pop("section"), given.pop("claim"))
    verdicts.judge(seed, **given)


def verdict_table():
    """The verdicts of this kernel as a pandas DataFrame (one row per claim), for the notebook's summary cell."""
    return verdicts.table()


def exercise(key: str, verify: Callable[[], bool], hint: str,
             tool_answer: Callable[[], dict] | None = None) -> bool:
    """The 'exercise-check' cells: "correct" or "not yet" with a hint, never a crash for the learner.

    `verify` is called here, so a name the learner has not defined yet (an emptied solution cell in a student
    copy) reads as "not yet". With LABKIT_STRICT_EXERCISES=1 (`make test`, `labkit run`) a "not yet" fails the
    notebook: that is how CI proves every shipped solution solves its exercise. In strict mode inside a kernel
    the check must also be able to fail (see `_prove_check_can_fail`): it must reject the emptied solution cell
    (the cell run just before this one) and, when given, `tool_answer()` - names -> values computed with the
    labkit function the learner is meant to replace by hand."""
    try:
        ok, why = bool(verify()), ""
    except Exception as exc:  # the learner's code, or the lack of it: report it, do not crash the check cell
        ok, why = False, f" ({type(exc).__name__}: {exc})"
    strict = os.environ.get(STRICT_EXERCISES_ENV) == "1"
    if ok:
        if strict:
            solution = _solution_source()
            if solution is not None:
                failed = _prove_check_can_fail(verify, solution, tool_answer)
                if failed:
                    raise AssertionError(f"exercise {key}: {failed}")
        print(f"✓ 练习 {key}：正确 / exercise {key}: correct")
        return True
    message = f"练习 {key}：还没有 / exercise {key}: not yet{why}. 提示 / hint: {hint}"
    if strict:
        raise AssertionError(message)
    print(f"✗ {message}")
    return False


_CELLS: list[str] = []  # the last two cells the kernel started, in strict mode: [solution, check] at a check


def _remember(info) -> None:
    """IPython's pre_run_cell hook: keep the source of the cell starting now and of the one before it."""
    from IPython import get_ipython

    _CELLS[:] = [*_CELLS[-1:], get_ipython().transform_cell(info.raw_cell)]


def _watch_cells() -> None:
    """In strict mode inside a kernel, remember each cell's source as it starts (nbval runs cells without input
    history, so `In` cannot be relied on). Registered once per shell, however often `setup` runs (a re-run first
    cell would otherwise record every cell twice, and the "cell before the check" would be the check itself)."""
    if os.environ.get(STRICT_EXERCISES_ENV) != "1":
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or _remember in shell.events.callbacks["pre_run_cell"]:
        return
    shell.events.register("pre_run_cell", _remember)


def _solution_source() -> str | None:
    """The cell run just before the running check cell (None outside a kernel, where nothing was watched).

    Every notebook puts a check cell right after its solution cell (tests/test_exercise.py holds them to it)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    if get_ipython() is None:
        return None
    if len(_CELLS) < 2:
        raise AssertionError("strict exercises: no solution cell ran before this check cell")
    return _CELLS[-2]


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
           ast.GeneratorExp)  # scopes of their own: what they bind is not the cell's


def _stores(node) -> list[str]:
    """Names `node` binds in the scope it runs in, not inside a def, class or lambda it contains."""
    if isinstance(node, _SCOPES):
        return [node.name] if hasattr(node, "name") else []
    if isinstance(node, ast.Name):
        return [node.id] if isinstance(node.ctx, ast.Store) else []
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return [n for child in ast.iter_child_nodes(node) for n in _stores(child)]


def _bound_names(source: str) -> list[str]:
    """Names a cell binds at top level (assignments, for / with targets, defs, classes, imports), also inside
    top-level if / for / while / with / try blocks, never inside a def, class or lambda."""
    names = [n for stmt in ast.parse(source).body for n in _stores(stmt)]
    return list(dict.fromkeys(n for n in names if n != "_"))


def _accepts(verify: Callable[[], bool], ns: dict, remove: list[str], bind: dict) -> bool:
    """Whether `verify` answers "correct" with `remove` absent from `ns` and `bind` bound; `ns` is left exactly
    as it was (same keys, same objects), also when verify raises."""
    saved = {k: ns[k] for k in [*remove, *bind] if k in ns}
    try:
        for k in remove:
            ns.pop(k, None)
        ns.update(bind)
        try:
            return bool(verify())
        except Exception:  # an exception is "not yet", which is what the proof wants
            return False
    finally:
        for k in [*remove, *bind]:
            ns.pop(k, None)
        ns.update(saved)


def _prove_check_can_fail(verify: Callable[[], bool], solution_source: str,
                          tool_answer: Callable[[], dict] | None = None) -> str | None:
    """Prove a check that accepted the shipped solution can also say "not yet"; the failed proof, or None.

    (a) the emptied solution: every name the solution cell binds at top level is removed from the check's
    globals for one call of `verify`, as in a student copy, and the check must answer "not yet" (False or an
    exception). What this cannot prove: a name an earlier cell also defined is absent here, whereas in a student
    copy it keeps the earlier cell's value - a check that accepts that earlier value is not caught.
    A binding made inside a magic (`%time y = 1`) is not seen, so such a name stays and the proof fails loudly.
    (b) the tool's own answer: the names -> values from `tool_answer()` (computed with the labkit function the
    exercise asks to replace by hand) are bound instead of the solution's, and the check must reject them.
    The check's globals are put back exactly as they were after each call."""
    ns = getattr(verify, "__globals__", None)
    if ns is None:
        from IPython import get_ipython

        ns = get_ipython().user_ns
    names = _bound_names(solution_source)
    if _accepts(verify, ns, names, {}):
        return "the check accepts an emptied solution"
    if tool_answer is not None and _accepts(verify, ns, names, dict(tool_answer())):
        return "the check accepts the tool's own answer"
    return None


def record(name: str, value) -> None:
    """Record a key figure for `labkit run`'s summary page (a no-op outside `labkit run`)."""
    import json

    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}
    data[name] = value

    atomic_write_text(p, json.dumps(data, ensure_ascii=False, default=str))
