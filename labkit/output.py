"""What a command prints. With `--json`, stdout carries exactly one JSON object, also on failure; everything else
(logs, warnings, progress bars, and C++ code writing to fd 1) goes to stderr."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from labkit.errors import LabkitError, LabkitFailure
from labkit.io import disk_error

JSON_HELP = "print one JSON object on stdout"


def common_flags(json_help: str = JSON_HELP) -> argparse.ArgumentParser:
    """The parent parser of every command: the flags all of them share (`json_help` may say what the object is)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help=json_help)
    return parent


def add_common_flags(parser: argparse.ArgumentParser, json_help: str = JSON_HELP) -> None:
    """Give a command's parser the flags of common_flags() at this point of its help (`parents=` would list them
    first, and a subcommand's parser already exists when its module's add_cli receives it)."""
    parser._add_container_actions(common_flags(json_help))


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
    """Print a result: one JSON object with --json, else the human text (or key: value lines)."""
    if getattr(args, "json", False):
        out = getattr(args, "_json_out", sys.stdout)
        out.write(json.dumps(payload, default=str) + "\n")
        out.flush()
    else:
        if text is None:
            text = "\n".join(f"{k}: {v}" for k, v in payload.items())
        print(text)


def run_error(args, e, want_json: bool) -> int:
    """Print a LabkitError as `labkit <command>: error: ...` and its fix; the exit status (2, or 1 for failures)."""
    print(f"labkit {args.command}: error: {e.what}", file=sys.stderr)
    if e.fix:
        print(f"  fix: {e.fix}", file=sys.stderr)
    if want_json:
        emit(args, {"ok": False, "error": e.what, "fix": e.fix})
    return 1 if isinstance(e, LabkitFailure) else 2


def run(args) -> int:
    """Call a parsed command's handler: a LabkitError becomes `labkit <command>: error: ...` and its fix on stderr
    (exit 2, or 1 for a LabkitFailure), never a traceback; with --json the answer is one JSON object either way."""
    want_json = getattr(args, "json", False)
    with (stdout_to_stderr() if want_json else contextlib.nullcontext(sys.stdout)) as out:
        args._json_out = out
        try:
            return int(args.func(args) or 0)
        except LabkitError as e:
            return run_error(args, e, want_json)
        except BrokenPipeError:  # e.g. `labkit convert hf2ms --show-mapping | head`
            return 0
        except OSError as e:  # a full disk or a read-only folder met outside labkit.io: still one clear line
            import errno

            better = disk_error(e, getattr(e, "filename", None) or "the output")
            if better is None or e.errno not in (errno.ENOSPC, errno.EROFS):  # EACCES may come from a read
                raise
            return run_error(args, better, want_json)
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
