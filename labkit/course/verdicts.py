"""A seed claim judged in the run: the seed's sentence, the quantity this run measured, and the rule that judges it.

A verdict is never a boolean the notebook computed beforehand. The call hands over what was measured and a small
typed rule that carries the seed's own number (a band, a threshold with its direction, a comparison of two measured
figures, an expected outcome); the rule decides "held here" or "did not hold here", and the line printed shows the
measured value and the rule, so a reader can disagree with the threshold.

Strict mode (LABKIT_STRICT_EXERCISES=1, as in CI and `labkit run`) proves that every rule can go either way: the call
states a counter-value (`other_side=`) and the rule must judge it opposite to the measured one; where the measurement
may land on either side, `other_side=Sides(holds=..., fails=...)` states one of each and the rule must judge both so. The counter-value
must be one the cell's own checks would still allow (a value the cell's asserts pin cannot be the other side: then
the verdict is fixed before it is computed, and the claim is "not testable here" instead).

A claim nothing here can decide is `not_testable(...)`: the reason, and the CPU figure beside it as an illustration.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.course.runner import FIGURES_ENV, STRICT_EXERCISES_ENV
from labkit.io import atomic_write_text

VERDICT_WORDS = {True: ("成立", "held here"), False: ("不成立", "did not hold here"),
                 None: ("此处无法检验", "not testable here")}
# What a verdict rests on. "measured": a value this run measured; "planner": the planner's memory/time model, not a
# run of the layout; "config": reading a shipped or upstream config; "not testable": nothing here can decide it.
BASIS_WORDS = {"measured": ("此处实测", "measured here"), "planner": ("规划器的模型", "from the planner's model"),
               "config": ("读自配置", "from the config"), "not testable": ("此处无法检验", "not testable here")}
VERDICTS: list[dict] = []  # every verdict of this kernel, in order: the notebook's summary table is made from it
COLUMNS = ["seed item", "section", "claim", "measured", "rule", "verdict", "basis", "figure"]


def show(value) -> str:
    """A measured value as printed: floats to 4 significant digits, pairs as (a, b)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(show(v) for v in value) + ")"
    return str(value)


@dataclass(frozen=True)
class Band:
    """Holds when lo <= measured <= hi: the seed's "about 30%" read as a stated band. `seed`: the seed's number."""
    lo: float
    hi: float
    seed: str
    name: str = "x"

    def judge(self, value) -> bool:
        return bool(self.lo <= value <= self.hi)

    def __str__(self) -> str:
        return f"{show(self.lo)} ≤ {self.name} ≤ {show(self.hi)} (seed: {self.seed})"


_OPS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


@dataclass(frozen=True)
class Threshold:
    """Holds when measured `op` limit, op one of >=, >, <=, <: a threshold with its direction."""
    op: str
    limit: float
    seed: str
    name: str = "x"

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"Threshold op {self.op!r}: use one of {', '.join(_OPS)}")

    def judge(self, value) -> bool:
        return bool(_OPS[self.op](value, self.limit))

    def __str__(self) -> str:
        return f"{self.name} {self.op} {show(self.limit)} (seed: {self.seed})"


@dataclass(frozen=True)
class Compare:
    """Two measured figures, measured = (a, b): holds when a `op` b * factor (factor 1: a plain comparison; 2: "a is
    at least twice b"). `names` label a and b in the printed rule."""
    op: str
    seed: str
    names: tuple = ("a", "b")
    factor: float = 1.0

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"Compare op {self.op!r}: use one of {', '.join(_OPS)}")

    def judge(self, value) -> bool:
        a, b = value
        return bool(_OPS[self.op](a, b * self.factor))

    def __str__(self) -> str:
        times = "" if self.factor == 1 else f"{show(self.factor)} × "
        return f"{self.names[0]} {self.op} {times}{self.names[1]} (seed: {self.seed})"


@dataclass(frozen=True)
class Outcome:
    """Holds when the measured outcome equals the one the seed states (a name, a yes/no the run observed)."""
    expected: object
    seed: str
    name: str = "outcome"

    def judge(self, value) -> bool:
        return bool(value == self.expected)

    def __str__(self) -> str:
        return f"{self.name} == {show(self.expected)} (seed: {self.seed})"


@dataclass(frozen=True)
class Beyond:
    """A difference (lower is better, e.g. a loss) judged against the noise measured in the same run: holds when
    lower by more than `noise`, does not hold when higher by more, and cannot tell within it (judge gives None and
    the verdict says "not testable here")."""
    noise: float
    seed: str
    name: str = "difference"

    def judge(self, value) -> bool | None:
        return True if value < -self.noise else False if value > self.noise else None  # plain bools, numpy or not

    def __str__(self) -> str:
        return f"{self.name} < -{show(self.noise)} (held), > +{show(self.noise)} (not held), the seed-to-seed " \
               f"noise between (seed: {self.seed})"


Rule = Band | Threshold | Compare | Outcome | Beyond


@dataclass(frozen=True)
class Sides:
    """A counter-value on each side, for a measurement that may land on either: `holds` the rule must accept and
    `fails` it must reject (both values the cell's own checks allow); strict mode checks both."""
    holds: object
    fails: object


@dataclass(frozen=True)
class Seed:
    """The claim a verdict judges, in the seed's own words: the seed-coverage item number, the seed's sentence in
    Chinese exactly as the seed writes it, where (e.g. "S0 §3.3"), and the same claim in English."""
    item: object
    quote: str
    section: str
    claim: str


NOT_GIVEN = object()


def _strict() -> bool:
    return os.environ.get(STRICT_EXERCISES_ENV) == "1"


def judge(seed: Seed, measured, rule: Rule, other_side=NOT_GIVEN, figure: str = "",
          basis: str = "measured") -> bool | None:
    """A seed claim judged in this run (see the module's docstring); returns the verdict (True: held here;
    None when a Beyond rule finds the difference within the noise).

    measured: what this run measured (a number, a pair for Compare, an outcome for Outcome); rule: what judges it,
    with the seed's number; other_side: a value the cell's own checks would still allow that the rule judges the
    other way, or Sides(holds, fails) when the measurement may land on either side (required in strict mode);
    figure: context for the reader; basis: "measured", "planner" or "config"."""
    if basis not in BASIS_WORDS or basis == "not testable":
        raise ValueError(f"verdict #{seed.item}: basis {basis!r}: use measured, planner or config (or not_testable())")
    held = rule.judge(measured)
    if _strict():
        _prove_open(seed, rule, measured, held, other_side)
    if held is None:  # the rule cannot tell (within the noise): the claim is not testable by this run
        _keep(seed, None, "not testable", show(measured), str(rule),
              "within the noise, this run cannot tell" + (f"; {figure}" if figure else ""))
        return None
    _keep(seed, bool(held), basis, show(measured), str(rule), figure)
    return bool(held)


def _prove_open(seed: Seed, rule: Rule, measured, held, other_side) -> None:
    """Strict mode: the stated counter-value must be judged the other way (a Sides: one of each as stated)."""
    if other_side is NOT_GIVEN:
        raise AssertionError(f"verdict #{seed.item}: strict mode needs other_side=, a value the cell's checks allow "
                             "that the rule judges the other way (else the claim is not testable here)")
    if isinstance(other_side, Sides):
        if rule.judge(other_side.holds) is not True or rule.judge(other_side.fails) is not False:
            raise AssertionError(f"verdict #{seed.item}: the rule {rule} does not hold at {show(other_side.holds)} "
                                 f"and fail at {show(other_side.fails)} as stated: it cannot be shown to go either way")
    elif rule.judge(other_side) in (held, None):
        raise AssertionError(f"verdict #{seed.item}: the rule {rule} judges the measured {show(measured)} and the "
                             f"stated other side {show(other_side)} the same: this verdict cannot come out the "
                             "other way")


def not_testable(item: int, quote: str, section: str, claim: str, reason: str, illustration: str = "") -> None:
    """A seed claim nothing here can decide: `reason` says why (the hardware or scale it needs), `illustration` gives
    the CPU figure beside it, which illustrates and does not judge."""
    _keep(Seed(item, quote, section, claim), None, "not testable", "—", "—",
          reason + (f"; CPU illustration: {illustration}" if illustration else ""))


def _keep(seed: Seed, held, basis: str, measured: str, rule: str, figure: str) -> None:
    zh, en = VERDICT_WORDS[held]
    basis_zh, basis_en = BASIS_WORDS[basis]
    row = {"seed item": seed.item, "section": seed.section, "quote": seed.quote, "claim": seed.claim,
           "measured": measured, "rule": rule, "verdict": en, "basis": basis_en, "figure": figure}
    key = (seed.item, seed.claim)
    VERDICTS[:] = [v for v in VERDICTS if (v["seed item"], v["claim"]) != key] + [row]  # a re-run cell
    head = f"[#{seed.item} {seed.section}] 「{seed.quote}」" if seed.quote else f"[{seed.item}]"
    lines = [head, f"  {seed.claim}"]
    if rule != "—":
        lines.append(f"  测得 / measured: {measured}; 规则 / rule: {rule}")
    how = figure if held is None else f"{basis_zh} / {basis_en}" + (f"; {figure}" if figure else "")
    lines.append(f"  → {zh} / {en.upper()} ({how})")
    print("\n".join(lines))
    _record(row)


def _record(row: dict) -> None:
    """Add the verdict to the figures file `labkit run` reads (a no-op outside `labkit run`); a re-run replaces."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}
    rows = [r for r in data.get("verdicts", []) if (r["seed item"], r["claim"]) != (row["seed item"], row["claim"])]
    data["verdicts"] = [*rows, row]
    atomic_write_text(p, json.dumps(data, ensure_ascii=False, default=str))


def legacy(item: str, claim: str, held: bool | None, figure: str, basis: str | None = None) -> None:
    """The old form verdict(item, claim, held, figure): still shown, with a notice that it proves nothing about its
    rule (a boolean computed by the cell can be fixed before it is computed)."""
    if held not in VERDICT_WORDS:
        raise ValueError(f"verdict {item!r}: held must be True, False or None (not testable), not {held!r}")
    basis = basis or ("not testable" if held is None else "measured")
    if basis not in BASIS_WORDS:
        raise ValueError(f"verdict {item!r}: basis {basis!r} is not one of {', '.join(BASIS_WORDS)}")
    if (held is None) != (basis == "not testable"):
        raise ValueError(f"verdict {item!r}: held={held} with basis {basis!r}: a claim is not testable here exactly "
                         "when held is None (then give basis 'not testable', or leave it out, and say why in figure)")
    print(f"deprecated: verdict({item!r}, ...) without measured= and rule=; its outcome is not proven to be open",
          file=sys.stderr)
    _keep(Seed(item, "", "", claim), held, basis, "—", "—", figure)


def table():
    """The verdicts of this kernel as a pandas DataFrame (one row per claim), for the notebook's summary cell."""
    import pandas as pd

    return pd.DataFrame(VERDICTS, columns=COLUMNS)
