"""What msrun runs in each process of a job: `python -m labkit.launch train ARGS` is `labkit train ARGS` in a
worker and only `mindspore.communication.init()` in the scheduler (which would otherwise import mindformers for
nothing, ~6 s of CPU per launch). Also the launcher's guard process and the all-reduce probe's workers.
An entry point like cli.py: it dispatches and holds no logic of its own."""
from __future__ import annotations

import argparse
import os
import sys

from labkit.runtime import prepare_process
from labkit.training.trainer import add_cli, device_target_of


def task(argv: list[str]) -> int:
    from labkit.output import run  # here, not at the top: the guard process imports this module and needs neither

    parser = argparse.ArgumentParser(prog="labkit train")
    add_cli(parser)
    args = parser.parse_args(argv)
    args.command = "train"
    prepare_process(device_target_of(args))  # the launcher's job env already holds these; a value set wins
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        from mindspore.communication import init

        init()  # the scheduler serves the workers until they finish
        return 0
    return run(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        sys.exit(task(sys.argv[2:]))
    elif sys.argv[1:2] == ["guard"]:
        from labkit.launch.supervisor import guard

        guard(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["probe"]:
        from labkit.launch.probe import probe_worker

        prepare_process("CPU")  # the all-reduce probe measures the CPU backend
        probe_worker(sys.argv[2])
    else:
        sys.exit("usage: python -m labkit.launch train ARGS | guard PARENT_PID ROOT_PID | probe SPEC.json")
