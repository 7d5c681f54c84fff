"""`labkit` command line. It only dispatches: each subcommand lives in its module, which provides
`add_cli(parser)` (arguments, and `parser.set_defaults(func=...)`); handlers return an exit code.

Modules import MindSpore, mindformers and torch inside functions, so `labkit --help` and `labkit plan` stay fast.
With `--json`, stdout carries exactly one JSON object, also on failure; everything else goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys

from .errors import LabkitError, LabkitFailure

COMMANDS = {
    "doctor": ("labkit.env", "check versions, devices and model registries"),
    "run": ("labkit.runner", "execute the notebooks with papermill into runs/"),
    "convert": ("labkit.convert", "convert Llama checkpoints HF <-> MindSpore"),
    "parity": ("labkit.parity", "compare HF and MindSpore logits on the same tokens"),
    "tokenizer": ("labkit.tokenizer", "train, compare and resize tokenizers"),
    "data": ("labkit.data", "build and benchmark MindRecord datasets"),
    "train": ("labkit.train", "train a mindformers Llama with MindSpore"),
    "launch": ("labkit.launch", "start labkit train under msrun on N workers"),
    "plan": ("labkit.plan", "plan the parallel strategy: memory and time per card"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="MindSpore LLM pretraining lab")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            importlib.import_module(module).add_cli(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(func=lambda a, n=name: _missing(n))
    return parser


def _missing(name: str) -> int:
    raise LabkitError(f"'labkit {name}' is not part of this version of the lab")


@contextlib.contextmanager
def stdout_to_stderr():
    """Route everything printed (also by C++ code writing to fd 1) to stderr; yield the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    real = os.fdopen(os.dup(saved), "w")
    os.dup2(2, 1)
    old = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield real
    finally:
        sys.stdout.flush()
        sys.stdout = old
        os.dup2(saved, 1)
        os.close(saved)


def emit(args, payload: dict, text: str | None = None) -> None:
    """Print a result: one JSON object with --json, else the human text (or YAML-ish key: value lines)."""
    if getattr(args, "json", False):
        out = getattr(args, "_json_out", sys.stdout)
        out.write(json.dumps(payload, default=str) + "\n")
        out.flush()
    else:
        if text is None:
            text = "\n".join(f"{k}: {v}" for k, v in payload.items())
        print(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    want_json = getattr(args, "json", False)
    with (stdout_to_stderr() if want_json else contextlib.nullcontext(sys.stdout)) as out:
        args._json_out = out
        try:
            return int(args.func(args) or 0)
        except LabkitError as e:
            code = 1 if isinstance(e, LabkitFailure) else 2
            print(f"labkit {args.command}: error: {e.what}", file=sys.stderr)
            if e.fix:
                print(f"  fix: {e.fix}", file=sys.stderr)
            if want_json:
                emit(args, {"ok": False, "error": e.what, "fix": e.fix})
            return code
        except BrokenPipeError:  # e.g. `labkit convert hf2ms --show-mapping | head`
            return 0
        except KeyboardInterrupt:
            if want_json:
                emit(args, {"ok": False, "error": "interrupted"})
            return 130
        except Exception as e:  # a bug or a library failure: keep the traceback, still answer in JSON
            if not want_json:
                raise
            import traceback

            traceback.print_exc()
            emit(args, {"ok": False, "error": f"{type(e).__name__}: {e}", "fix": None})
            return 1
        finally:
            if want_json:
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
