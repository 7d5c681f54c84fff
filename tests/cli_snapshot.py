"""Record what the CLI shows: `--help` of every command and subcommand, and the keys of cheap `--json` answers.
`python tests/cli_snapshot.py > tests/golden/cli_snapshot.json` rewrites the fixture that test_cli_snapshot.py
compares with; the fixture was first written from the layout before labkit became subpackages."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

JSON_COMMANDS = {  # name: argv (cheap: no training, no device probe)
    "plan": ["plan", "--preset", "llama2_7b", "--devices", "8", "--device-memory", "64", "--json"],
    "convert --show-mapping": ["convert", "hf2ms", "--show-mapping", "--json"],
    "launch --dry-run": ["launch", "--workers", "2", "--config", "configs/dp2_cpu.yaml", "--dry-run", "--json",
                         "--output", "{tmp}/dp"],
    "error": ["train", "--config", "{tmp}/missing.yaml", "--json"],
}


def helps() -> dict:
    from labkit.cli import build_parser

    out = {}

    def walk(p: argparse.ArgumentParser, name: str):
        out[name] = p.format_help()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(sp, f"{name} {sub}".strip())

    os.environ["COLUMNS"] = "120"
    walk(build_parser(), "labkit")
    return out


def json_keys() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in JSON_COMMANDS.items():
            argv = [a.replace("{tmp}", tmp) for a in argv]
            r = subprocess.run([sys.executable, "-m", "labkit", *argv], capture_output=True, text=True, timeout=600)
            out[name] = sorted(json.loads(r.stdout))
    return out


def snapshot() -> dict:
    return {"help": helps(), "json_keys": json_keys()}


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1, ensure_ascii=False, sort_keys=True))
