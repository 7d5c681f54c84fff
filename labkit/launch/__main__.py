"""What msrun runs in each process of a job: `python -m labkit.launch train ARGS` is `labkit train ARGS` in a
worker and only `mindspore.communication.init()` in the scheduler (which would otherwise import mindformers for
nothing, ~6 s of CPU per launch). Also the launcher's guard process and the all-reduce probe's workers.
An entry point like cli.py: it dispatches and holds no logic of its own."""
from __future__ import annotations

import os
import sys


def task(argv: list[str]) -> int:
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        os.environ.setdefault("GLOG_v", "3")
        from mindspore.communication import init

        init()  # the scheduler serves the workers until they finish
        return 0
    import argparse

    from labkit.output import run
    from labkit.training.trainer import add_cli

    parser = argparse.ArgumentParser(prog="labkit train")
    add_cli(parser)
    args = parser.parse_args(argv)
    args.command = "train"
    return run(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        sys.exit(task(sys.argv[2:]))
    elif sys.argv[1:2] == ["guard"]:
        from labkit.launch.supervisor import guard

        guard(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["probe"]:
        from labkit.launch.probe import probe_worker

        probe_worker(sys.argv[2])
    else:
        sys.exit("usage: python -m labkit.launch train ARGS | guard PARENT_PID ROOT_PID | probe SPEC.json")
