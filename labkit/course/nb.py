"""Small helpers every notebook calls first: quiet logs, a run folder, checks that fail loudly."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from labkit.course.runner import FIGURES_ENV, STRICT_EXERCISES_ENV
from labkit.paths import RUNS
from labkit.runtime import prepare_process


def setup(name: str, output_dir: str | os.PathLike | None = None, device_target: str = "CPU") -> Path:
    """Prepare the kernel's process for `device_target` (labkit.runtime: quiet logs, MindSpore's launch mode; call
    it before importing MindSpore), make and return the run folder.

    `output_dir=None` gives runs/notebooks/<name> under the lab root, whatever the working directory."""
    prepare_process(device_target)
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


VERDICT_WORDS = {True: ("成立", "held here"), False: ("不成立", "did not hold here"),
                 None: ("此处无法检验", "not testable here")}
# What a verdict rests on. "measured": a value this run measured; "planner": the planner's memory/time model, not a
# run of the layout; "config": reading a shipped or upstream config; "not testable": nothing here can decide it
# (held=None, and `figure` says why: hardware the learner lacks is "not testable", never "did not hold" from a CPU run).
BASIS_WORDS = {"measured": ("此处实测", "measured here"), "planner": ("规划器的模型", "from the planner's model"),
               "config": ("读自配置", "from the config"), "not testable": ("此处无法检验", "not testable here")}
VERDICTS: list[dict] = []  # every verdict of this kernel, in order: the notebook's summary table is made from it


def verdict(item: str, claim: str, held: bool | None, figure: str, basis: str | None = None) -> None:
    """A seed claim judged in this run: held (True), did not hold (False), or not testable here (None; `figure` then
    says why). `basis` says what the judgement rests on (BASIS_WORDS): by default "measured" when held is True/False
    and "not testable" when it is None; pass "planner" or "config" when the figure comes from the planner's model or
    from reading a config rather than from a measurement. Printed, kept in VERDICTS for `verdict_table()`, and
    recorded for `labkit run`'s summary (returns nothing, so a cell that ends with a verdict shows only its line).
    Assert the `held` you pass against the figures in the same cell."""
    if held not in VERDICT_WORDS:
        raise ValueError(f"verdict {item!r}: held must be True, False or None (not testable), not {held!r}")
    basis = basis or ("not testable" if held is None else "measured")
    if basis not in BASIS_WORDS:
        raise ValueError(f"verdict {item!r}: basis {basis!r} is not one of {', '.join(BASIS_WORDS)}")
    if (held is None) != (basis == "not testable"):
        raise ValueError(f"verdict {item!r}: held={held} with basis {basis!r}: a claim is not testable here exactly "
                         "when held is None (then give basis 'not testable', or leave it out, and say why in figure)")
    zh, en = VERDICT_WORDS[held]
    basis_zh, basis_en = BASIS_WORDS[basis]
    row = {"seed item": item, "claim": claim, "verdict": en, "basis": basis_en, "figure": figure}
    VERDICTS[:] = [v for v in VERDICTS if (v["seed item"], v["claim"]) != (item, claim)] + [row]  # re-run cell
    on = "" if held is None else f"{basis_zh} / {basis_en}: "
    print(f"[{item}] {claim}: {zh} / {en.upper()} ({on}{figure})")
    record(f"verdict {item}: {claim}", f"{en}, {basis_en} ({figure})")


def verdict_table():
    """The verdicts of this kernel as a pandas DataFrame (one row per claim), for the notebook's summary cell."""
    import pandas as pd

    return pd.DataFrame(VERDICTS, columns=["seed item", "claim", "verdict", "basis", "figure"])


def exercise(key: str, verify: Callable[[], bool], hint: str) -> bool:
    """The 'exercise-check' cells: "correct" or "not yet" with a hint, never a crash for the learner.

    `verify` is called here, so a name the learner has not defined yet (an emptied solution cell in a student
    copy) reads as "not yet". With LABKIT_STRICT_EXERCISES=1 (`make test`, `labkit run`) a "not yet" fails the
    notebook: that is how CI proves every shipped solution solves its exercise."""
    try:
        ok, why = bool(verify()), ""
    except Exception as exc:  # the learner's code, or the lack of it: report it, do not crash the check cell
        ok, why = False, f" ({type(exc).__name__}: {exc})"
    if ok:
        print(f"✓ 练习 {key}：正确 / exercise {key}: correct")
        return True
    message = f"练习 {key}：还没有 / exercise {key}: not yet{why}. 提示 / hint: {hint}"
    if os.environ.get(STRICT_EXERCISES_ENV) == "1":
        raise AssertionError(message)
    print(f"✗ {message}")
    return False


def record(name: str, value) -> None:
    """Record a key figure for `labkit run`'s summary page (a no-op outside `labkit run`)."""
    import json

    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}
    data[name] = value
    from labkit.io import atomic_write_text

    atomic_write_text(p, json.dumps(data, ensure_ascii=False, default=str))
