"""A fault drill injected inside a worker: rank R ends itself with SIGKILL right after step K.

Killing a worker from outside (a launcher that watches rank 0's log and then sends the signal) lands wherever the
victim happens to be when the signal arrives: on a loaded machine rank 0 runs ahead of the watcher and the "mid-run"
kill can reach a worker that already finished. Injected at a step inside the worker, the drill is mid-run by
construction (K must lie inside the run) and leaves the same checkpoints on every machine: the rank dies after step
K's save and its barrier, so the newest complete checkpoint is the last one at or before step K, and none after it
(every later step needs the dead rank's gradients)."""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from labkit.errors import LabkitError


@dataclass(frozen=True)
class Fault:
    """A fault drill injected inside a worker: rank `rank` ends itself with SIGKILL right after step `after_step`
    (after that step's metrics and checkpoint, so what it leaves behind does not depend on any other process's speed).
    """

    rank: int
    after_step: int

    def hits(self, rank: int, step: int) -> bool:
        return rank == self.rank and step == self.after_step

    def die(self, log) -> None:
        log(f"fault drill: rank {self.rank} ends itself with SIGKILL after step {self.after_step}")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def check_fault(kill_rank: int | None, kill_after_step: int, world_size: int, start_step: int,
                steps: int) -> Fault | None:
    """The drill, or None without a rank; refused unless the kill falls inside the run (mid-run by construction)."""
    if kill_rank is None:
        return None
    if not 0 <= kill_rank < world_size:
        raise LabkitError(f"--kill-rank {kill_rank}: the job has ranks 0..{world_size - 1}",
                          f"give --kill-rank between 0 and {world_size - 1}")
    if not start_step < kill_after_step < steps:
        raise LabkitError(f"--kill-after-step {kill_after_step} is not inside the run (steps {start_step + 1}..{steps}: "
                          f"the kill must come after a step that runs and before the last)",
                          f"give --kill-after-step between {start_step + 1} and {steps - 1}, or raise --steps")
    return Fault(kill_rank, kill_after_step)
