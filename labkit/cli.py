"""`labkit` command line. It only dispatches: each subcommand lives in its module, which provides
`add_cli(parser)` (arguments, and `parser.set_defaults(func=...)`); handlers return an exit code.

Modules import MindSpore, mindformers and torch inside functions, so `labkit --help` and `labkit plan` stay fast.
With `--json`, stdout carries exactly one JSON object, also on failure; everything else goes to stderr.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from labkit.errors import LabkitError
from labkit.output import run
from labkit.runtime import prepare_process
from labkit.training.trainer import device_target_of

COMMANDS = {
    "doctor": ("labkit.doctor.env", "check versions, devices and model registries"),
    "run": ("labkit.course.runner", "execute the notebooks with papermill into runs/"),
    "student": ("labkit.course.student", "write student copies of the notebooks: solutions emptied, checks kept"),
    "convert": ("labkit.weights.convert", "convert Llama checkpoints HF <-> MindSpore"),
    "parity": ("labkit.weights.parity", "compare HF and MindSpore logits on the same tokens"),
    "tokenizer": ("labkit.data.tokenizer", "train, compare and resize tokenizers"),
    "data": ("labkit.data.commands", "build and benchmark MindRecord datasets"),
    "train": ("labkit.training.trainer", "train a mindformers Llama with MindSpore"),
    "generate": ("labkit.training.generate", "continue a prompt with a trained checkpoint (CPU sampler)"),
    "launch": ("labkit.launch.launcher", "start labkit train under msrun on N workers"),
    "plan": ("labkit.parallel.plan_cli", "plan the parallel strategy: memory and time per card"),
    "ckpt": ("labkit.byhand.ckpt_commands", "inspect, merge and reshard the by-hand layouts' sharded checkpoints"),
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


# Commands that only tokenise never use torch, which transformers imports whenever it is installed: ~6 s of the
# ~11 s a `labkit data build` process took on a 4 MB corpus. Set for a whole process only (argv None, the command
# line): a notebook or test calling main([...]) may need torch afterwards.
TORCH_FREE = {("data", "build"), ("data", "bench"), ("tokenizer", "compare"), ("tokenizer", "train")}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None:  # a process of its own (a caller of main([...]) prepared its process itself)
        # `labkit train`: its config's device target; the other commands use MindSpore, if at all, on the CPU
        target = device_target_of(args) if args.command == "train" else "CPU"
        torch_free = (args.command, getattr(args, "action", None)) in TORCH_FREE and "transformers" not in sys.modules
        prepare_process(target, torch=not torch_free)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
