"""labkit.output: the shared flags every command takes, where its help lists them."""
import argparse

from labkit.cli import build_parser
from labkit.output import add_common_flags


def test_common_flags_stay_where_they_are_added():
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--first")
    add_common_flags(p, "print one JSON object (the summary)")
    p.add_argument("--last")
    text = p.format_help()
    assert text.index("--first") < text.index("--json") < text.index("--last")
    assert "print one JSON object (the summary)" in text
    assert p.parse_args(["--json"]).json and not p.parse_args([]).json


def test_every_command_takes_json():
    def leaves(p: argparse.ArgumentParser, name: str):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield name, p
        for a in subs:
            for sub, sp in a.choices.items():
                yield from leaves(sp, f"{name} {sub}")

    found = dict(leaves(build_parser(), "labkit"))
    assert len(found) >= 9
    for name, p in found.items():
        flags = [a for a in p._actions if "--json" in a.option_strings]
        assert len(flags) == 1 and flags[0].help.startswith("print one JSON object"), name
