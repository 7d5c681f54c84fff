"""Verdicts: the rule judges the measured value, strict mode proves it can go either way, and every verdict a notebook
makes quotes a sentence the seeds contain, in the section it names, on an item of the seed-coverage audit."""
from __future__ import annotations

import ast
import json
import re

import pytest

from labkit.course import nb as nb_module
from labkit.course import runner, verdicts
from labkit.paths import NOTEBOOKS
from tests import seed_index

# Notebooks whose verdicts still use the old form verdict(item, claim, held, figure): each is converted in turn.
LEGACY = {"07_pretrain"}
QUOTE = dict(item=76, quote="用大约 30% 的额外计算时间", section="S0 §3.3", claim="recompute costs about 30% more time")


@pytest.fixture(autouse=True)
def _clean():
    nb_module.VERDICTS.clear()
    yield
    nb_module.VERDICTS.clear()


@pytest.mark.parametrize("rule, held, other", [
    (verdicts.Band(0.2, 0.4, seed="约 30%"), 0.3, 0.5),
    (verdicts.Threshold(">=", 0.9, seed="90%"), 0.95, 0.8),
    (verdicts.Threshold("<", 2.0, seed="2"), 1.0, 2.0),
    (verdicts.Compare(">", seed="more", names=("acc", "big")), (2, 1), (1, 1)),
    (verdicts.Compare(">=", seed="2x", factor=2), (4, 2), (3, 2)),
    (verdicts.Outcome("model.embedding.weight", seed="name"), "model.embedding.weight", "tok_embeddings"),
    (verdicts.Beyond(0.1, seed="lower"), -0.2, 0.2),
])
def test_each_rule_judges_both_ways(rule, held, other):
    assert rule.judge(held) is True and rule.judge(other) is False
    assert rule.seed in str(rule)


def test_numpy_values_are_judged_like_floats(monkeypatch):
    import numpy as np

    monkeypatch.setenv(verdicts.STRICT_EXERCISES_ENV, "1")
    rule = nb_module.Threshold("<", np.float64(0.145), seed="s")
    assert rule.judge(np.float64(-1)) is True and rule.judge(np.float64(2)) is False
    nb_module.verdict(**QUOTE, measured=np.float64(0.0), rule=rule, other_side=nb_module.Sides(holds=-1.0, fails=1.0))


def test_a_verdict_prints_measured_rule_and_outcome(capsys, monkeypatch):
    monkeypatch.setenv(verdicts.STRICT_EXERCISES_ENV, "1")
    nb_module.verdict(**QUOTE, measured=0.45, rule=nb_module.Band(0.2, 0.4, seed="约 30%", name="extra"),
                      other_side=0.3)
    out = capsys.readouterr().out
    assert "0.45" in out and "0.2 ≤ extra ≤ 0.4 (seed: 约 30%)" in out and "DID NOT HOLD HERE" in out
    assert "「用大约 30% 的额外计算时间」" in out
    row = nb_module.verdict_table().iloc[0]
    assert (row["seed item"], row["measured"], row["verdict"]) == (76, "0.45", "did not hold here")


def test_strict_mode_refuses_a_verdict_that_cannot_go_the_other_way(monkeypatch):
    monkeypatch.setenv(verdicts.STRICT_EXERCISES_ENV, "1")
    rule = nb_module.Threshold(">=", 3.96, seed="2-3x")
    with pytest.raises(AssertionError, match="judges the measured"):
        nb_module.verdict(**QUOTE, measured=4.0, rule=rule, other_side=5.0)
    with pytest.raises(AssertionError, match="other_side"):
        nb_module.verdict(**QUOTE, measured=4.0, rule=rule)
    with pytest.raises(AssertionError, match="either way"):
        nb_module.verdict(**QUOTE, measured=4.0, rule=rule, other_side=nb_module.Sides(holds=5.0, fails=6.0))
    assert not nb_module.VERDICTS
    nb_module.verdict(**QUOTE, measured=4.0, rule=rule, other_side=nb_module.Sides(holds=5.0, fails=1.0))
    monkeypatch.delenv(verdicts.STRICT_EXERCISES_ENV)
    nb_module.verdict(**QUOTE, measured=4.0, rule=rule)  # outside strict mode the proof is not asked for
    assert list(nb_module.verdict_table()["verdict"]) == ["held here"]  # one row: the re-run replaced the first


def test_a_difference_within_the_noise_is_not_testable(capsys, monkeypatch):
    monkeypatch.setenv(verdicts.STRICT_EXERCISES_ENV, "1")
    rule = nb_module.Beyond(0.1, seed="3%", name="loss with - without")
    nb_module.verdict(**QUOTE, measured=0.05, rule=rule, other_side=nb_module.Sides(holds=-1.0, fails=1.0))
    assert "NOT TESTABLE HERE (within the noise" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="the same"):
        nb_module.verdict(**QUOTE, measured=0.05, rule=rule, other_side=0.0)  # also within the noise: proves nothing
    assert list(nb_module.verdict_table()["verdict"]) == ["not testable here"]


def test_not_testable_gives_the_reason_and_the_illustration(capsys):
    nb_module.not_testable(**QUOTE, reason="needs 8 A100", illustration="CPU: +12%")
    out = capsys.readouterr().out
    assert "NOT TESTABLE HERE (needs 8 A100; CPU illustration: CPU: +12%)" in out
    assert list(nb_module.verdict_table()["basis"]) == ["not testable here"]


def test_verdicts_reach_the_run_summary(tmp_path, monkeypatch):
    figures = tmp_path / "figures.json"
    monkeypatch.setenv(runner.FIGURES_ENV, str(figures))
    monkeypatch.delenv(nb_module.STRICT_EXERCISES_ENV, raising=False)  # these calls give no other_side
    nb_module.record("loss", 2.5)
    nb_module.verdict(**QUOTE, measured=0.31, rule=nb_module.Band(0.2, 0.4, seed="约 30%"), basis="planner")
    nb_module.verdict(**QUOTE, measured=0.5, rule=nb_module.Band(0.2, 0.4, seed="约 30%"))  # a re-run cell
    nb_module.not_testable(77, "在TrainOneStepCell的配置里对目标 Cell 调用cell.recompute()即可", "S0 §3.3",
                           "cell.recompute()", reason="why")
    data = json.loads(figures.read_text())
    res = runner.NotebookResult("04b.ipynb", "out", "ok", figures=data, verdicts=data.pop("verdicts"))
    runner.write_summary(tmp_path, [res], {})
    summary = (tmp_path / "summary.md").read_text()
    assert "loss: 2.5" in summary and "verdicts" not in summary.split("##")[0]
    rows = [line for line in summary.splitlines() if line.startswith("| 04b.ipynb | ")]
    assert len(rows) == 2 and "| 0.5 | 0.2 ≤ x ≤ 0.4 (seed: 约 30%) | did not hold here | measured here |" in rows[0]
    assert "not testable here" in rows[1]


def test_the_old_form_still_runs_with_a_notice(capsys):
    nb_module.verdict("s1", "x is small", True, "x = 1")
    captured = capsys.readouterr()
    assert "deprecated" in captured.err and "HELD HERE" in captured.out
    with pytest.raises(ValueError, match="basis"):
        nb_module.verdict("s", "c", None, "f", basis="measured")


def _code(cell: dict) -> str:
    """A code cell's source with IPython magics and shell lines blanked, so ast can read it."""
    lines = runner.cell_text(cell).splitlines()
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def _literals(tree: ast.AST) -> dict[str, ast.Constant]:
    """A cell's top-level NAME = "text" assignments: a quote used by several verdicts is written once."""
    return {node.targets[0].id: node.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)}


def verdict_calls() -> list[tuple[str, int, ast.Call]]:
    """Every nb.verdict / nb.not_testable call in the notebooks: (notebook stem, cell index, call), with a quote
    given by a name replaced by the literal the cell assigns to it."""
    out = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        book = json.loads(path.read_text(encoding="utf-8"))
        for i, cell in enumerate(book["cells"]):
            if cell["cell_type"] != "code":
                continue
            tree = ast.parse(_code(cell))
            names = _literals(tree)
            for node in ast.walk(tree):
                for k in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
                    if k.arg == "quote" and isinstance(k.value, ast.Name) and k.value.id in names:
                        k.value = names[k.value.id]
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("verdict", "not_testable") and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "nb"):
                    out.append((path.stem, i, node))
    return out


def _args(call: ast.Call) -> dict:
    args = dict(zip(["item"], call.args))  # the new form names everything after the item
    args.update({k.arg: k.value for k in call.keywords})
    return args


def test_the_notebooks_make_verdicts_and_only_the_legacy_ones_use_the_old_form():
    calls = verdict_calls()
    assert len(calls) > 50
    old = {stem for stem, _, call in calls if "quote" not in _args(call)}
    for stem, cell, call in calls:
        assert "quote" in _args(call) or stem in LEGACY, f"{stem} cell {cell}: give this verdict quote=, measured=, rule="
    assert LEGACY <= old, f"fully converted, drop from LEGACY: {sorted(LEGACY - old)}"


def test_every_quote_is_the_seeds_own_words_in_the_section_named():
    index = json.loads(seed_index.INDEX.read_text(encoding="utf-8"))
    checked = 0
    for stem, cell, call in verdict_calls():
        args = _args(call)
        if "quote" not in args:
            continue
        where = f"{stem} cell {cell}"
        values = {}
        for key in ("item", "quote", "section"):
            assert isinstance(args.get(key), ast.Constant), f"{where}: {key}= must be a literal, for this test to read"
            values[key] = args[key].value
        assert values["item"] in index["items"], f"{where}: item #{values['item']} is not in the seed-coverage audit"
        m = re.fullmatch(r"(S[01]) §(\d\.\d|end)", values["section"])
        assert m, f"{where}: section {values['section']!r}: write it as 'S0 §3.3' (or 'S1 §end')"
        found = seed_index.where(index, m.group(1), values["quote"])
        assert found is not None, f"{where}: 「{values['quote']}」 does not occur in {m.group(1)} (whitespace aside)"
        assert found == m.group(2), f"{where}: 「{values['quote']}」 is in {m.group(1)} §{found}, not §{m.group(2)}"
        checked += 1
    assert checked > 0


def test_the_fingerprint_finds_a_quote_and_refuses_a_misquote():
    index = json.loads(seed_index.INDEX.read_text(encoding="utf-8"))
    assert seed_index.where(index, "S0", "用大约 30% 的额外计算时间，换来 50%~70% 的激活显存节省") == "3.3"
    assert seed_index.where(index, "S0", "用大约 40% 的额外计算时间，换来 50%~70% 的激活显存节省") is None
    assert seed_index.where(index, "S1", "开激活重计算是第一选择其次是梯度累积最后才考虑降低batch size或seq_length") == "4.2"
    assert seed_index.where(index, "S1", "用大约 30% 的额外计算时间") is None
