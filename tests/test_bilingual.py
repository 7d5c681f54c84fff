"""Every markdown cell of more than one line carries Chinese text and at least one full English sentence
(issue 13, "Read, look, move on"). Reading checks that both say the same thing; this test checks that neither is
missing.

A full English sentence: at least four ASCII words ending in '.', ':', '!' or '?' (then a space or the end), with
no Chinese character inside it; or a heading line whose part after " / " is English ("## 3. 规划器 / The planner")."""
import json
import re

import pytest

from labkit.course.runner import course_notebooks

CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")
SENTENCE = re.compile(r"[^.:!?]+[.:!?](?=\s|$)")
MIN_WORDS = 4


def _plain(text: str) -> str:
    """Markdown without what is not prose: code blocks, inline code (kept as one word), link targets, emphasis."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "code", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"[*_]{1,3}", "", text)


def _is_heading(line: str) -> bool:
    return line.lstrip().startswith("#")


def _is_table(line: str) -> bool:
    return line.lstrip().startswith("|")


def english_sentences(text: str) -> list[str]:
    """The full English sentences of a markdown text (see the module docstring)."""
    found = []
    for line in _plain(text).splitlines():  # a heading with an English part: "# 06 自动并行 / Auto-parallel"
        if _is_heading(line) and " / " in line:
            tail = line.split(" / ", 1)[1]
            if WORD.search(tail) and not CJK.search(tail):
                found.append(tail.strip())
    flat = " ".join(line for line in _plain(text).splitlines() if not _is_heading(line) and not _is_table(line))
    for segment in CJK.split(flat):  # Chinese characters end any English run
        found += [s.strip() for s in SENTENCE.findall(segment) if len(WORD.findall(s)) >= MIN_WORDS]
    return found


def cell_problem(text: str) -> str | None:
    """What a markdown cell of more than one line lacks, or None.

    Chinese somewhere; and English: a sentence in the prose when the prose (lines that are neither headings nor
    table rows) has Chinese, a heading's English part otherwise; every table row with Chinese also has English
    words ("结论 / verdict")."""
    lines = [line for line in _plain(text).splitlines() if line.strip()]
    if len(lines) <= 1:
        return None
    if not CJK.search(text):
        return "no Chinese"
    prose = [line for line in lines if not _is_heading(line) and not _is_table(line)]
    if any(CJK.search(line) for line in prose):
        body = "\n".join(prose)
        if not english_sentences(body):
            return "Chinese prose without an English sentence"
    elif not english_sentences(text):
        return "no English sentence or heading"
    rows = [line for line in lines if _is_table(line) and CJK.search(line) and len(WORD.findall(line)) < 2]
    if rows:
        return f"table row without English: {rows[0][:50]}"
    return None


def bilingual_problems(book: dict) -> list[str]:
    """'[i] what is missing' for each markdown cell of more than one line lacking Chinese or English."""
    problems = []
    for i, cell in enumerate(book["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        problem = cell_problem(text)
        if problem:
            first = next(line for line in text.splitlines() if line.strip())[:60]
            problems.append(f"[{i}] {problem} ({first})")
    return problems


def test_the_rule_can_fail():
    cell = lambda text: {"cells": [{"cell_type": "markdown", "source": text}]}  # noqa: E731
    assert bilingual_problems(cell("只有中文。\n第二行中文。")) == [
        "[0] Chinese prose without an English sentence (只有中文。)"]
    assert bilingual_problems(cell("Only English here.\nA second line."))[0].startswith("[0] no Chinese")
    assert bilingual_problems(cell("中文说明。\nthree short words.")), "three words are not a sentence"
    assert bilingual_problems(cell("中文说明：`run.yaml`、`launch.sh`\nrun.yaml, launch.sh"))
    assert not bilingual_problems(cell("中文说明。\nThe run goes through `labkit launch` here."))
    assert not bilingual_problems(cell("## 验证 / Check\n两个进程合起来一致。The two workers agree with one process."))
    assert not bilingual_problems(cell("单行中文")), "one line is exempt"
    assert bilingual_problems(cell("## 小结 / Summary\n只有中文的段落。")), "a heading does not cover Chinese prose"
    assert not bilingual_problems(cell("## 结论 / Verdict\n| 说法 / claim | 结果 / result |\n|---|---|"))
    assert bilingual_problems(cell("## 结论 / Verdict\n| 说法 / claim |\n| 只有中文 |"))


@pytest.mark.parametrize("path", sorted(course_notebooks()), ids=lambda p: p.stem)
def test_markdown_cells_are_bilingual(path):
    problems = bilingual_problems(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.name}: markdown cells without both languages:\n" + "\n".join(problems)
