"""The CLI behaves as it did before labkit became subpackages: the same help for every command and subcommand,
and the same keys in the `--json` answers (fixture: tests/golden/cli_snapshot.json, written by
tests/cli_snapshot.py from the flat layout). A deliberate CLI change rewrites the fixture in the same commit."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import cli_snapshot  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "golden" / "cli_snapshot.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(GOLDEN["help"]))
def test_help_unchanged(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert cli_snapshot.helps()[name] == GOLDEN["help"][name]


def test_no_command_added_or_lost():
    assert sorted(cli_snapshot.helps()) == sorted(GOLDEN["help"])


@pytest.mark.slow
def test_json_keys_unchanged():
    assert cli_snapshot.json_keys() == GOLDEN["json_keys"]
