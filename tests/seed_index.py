"""The seeds as a fingerprint: where a quoted sentence occurs, without shipping the articles' text.

Each seed (S0, S1) is kept as the hashes of its every `WINDOW`-character window, whitespace removed, in order, with
the start of each numbered section; a quote occurs in the seed exactly when the hashes of its own windows appear there
as one contiguous run. The seed-coverage audit's item numbers ride along. Rebuild after a seed changes:
python tests/seed_index.py SEED0.txt SEED1.txt SEED_COVERAGE.md > tests/seed_index.json
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

WINDOW = 6  # characters per window: a quote must be at least this long
HEX = 8  # hex digits kept per window's hash
INDEX = Path(__file__).with_name("seed_index.json")
SECTIONS = ["1.1", "1.2", "1.3", "2.1", "2.2", "2.3", "2.4", "3.1", "3.2", "3.3", "3.4", "4.1", "4.2", "4.3", "4.4",
            "4.5"]
END = {"S0": "实战收尾", "S1": "最后说点实在的"}  # the unnumbered closing section of each seed: "§end"


def normalise(text: str) -> str:
    return re.sub(r"\s+", "", text)


def windows(text: str) -> str:
    text = normalise(text)
    return "".join(hashlib.sha256(text[i:i + WINDOW].encode()).hexdigest()[:HEX]
                   for i in range(len(text) - WINDOW + 1))


def _sections(raw: str, seed: str) -> list[tuple[str, int]]:
    """Each section's start as a position in the normalised text: the numbered headings in order, then §end."""
    out, at = [], 0
    for name in SECTIONS:
        m = re.compile(rf"(?<![\d.*^]){re.escape(name)} ?(?=[^\d\s*])").search(raw, at)
        if m is None:
            continue
        out.append((name, len(normalise(raw[:m.start()]))))
        at = m.end()
    out.append(("end", len(normalise(raw[:raw.index(END[seed], at)]))))
    return out


def _items(coverage: str) -> list[int]:
    items = set()
    for line in coverage.splitlines():
        m = re.match(r"\|\s*(\d[\d,–\- ]*)\|", line)
        for part in (m.group(1).split(",") if m else []):
            lo, _, hi = part.strip().replace("–", "-").partition("-")
            items.update(range(int(lo), int(hi or lo) + 1))
    return sorted(items)


def build(seed0: Path, seed1: Path, coverage: Path) -> dict:
    seeds = {}
    for name, path in (("S0", seed0), ("S1", seed1)):
        raw = path.read_text(encoding="utf-8")
        seeds[name] = {"windows": windows(raw), "sections": _sections(raw, name)}
    return {"window": WINDOW, "hex": HEX, "seeds": seeds, "items": _items(coverage.read_text(encoding="utf-8"))}


def where(index: dict, seed: str, quote: str) -> str | None:
    """The section ("3.3", "end") where `quote` occurs in `seed`, or None when it does not occur there."""
    if len(normalise(quote)) < index["window"]:
        return None
    hay, needle, step = index["seeds"][seed]["windows"], windows(quote), index["hex"]
    at = hay.find(needle)
    while at != -1 and at % step:
        at = hay.find(needle, at + 1)
    if at == -1:
        return None
    pos, section = at // step, None
    for name, start in index["seeds"][seed]["sections"]:
        if start <= pos:
            section = name
    return section


if __name__ == "__main__":
    print(json.dumps(build(*map(Path, sys.argv[1:4])), ensure_ascii=False))
