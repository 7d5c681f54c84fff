"""Start `labkit train` on N worker processes with msrun, watch them, and end every one of them.

    labkit launch --workers 2 --config configs/dp2_cpu.yaml            # 2 data-parallel workers on this machine
    labkit launch --workers 8 --nodes 2 --node-rank R --master-addr HOST --master-port P ...   # on each of 2 nodes

What `launch()` does, in order:
1. Validates before anything starts: the config, the parallel mode for the worker count (more than one worker means
   `data_parallel` unless the config says otherwise), global batch = micro_batch x dp x accum against
   `train.global_batch`, the dataset (built here once on first use, so ranks never race to build it), the output
   folder (resume needs a checkpoint; an old run is not silently mixed in), the master port (a given port that is
   busy is an error; none given = a free one).
2. Writes the resolved config to <output>/launch.yaml and starts
   `msrun --worker_num=M*N --local_worker_num=N ... python -m labkit.launch train --config <output>/launch.yaml`
   with the caller's interpreter first on PATH (msrun starts workers with the `python` it finds there).
   msrun runs that command for its scheduler process too: `python -m labkit.launch train` is exactly
   `labkit train` in a worker and only `mindspore.communication.init()` in the scheduler (which would otherwise
   import mindformers for nothing, ~6 s of CPU per launch). Per-rank logs: <output>/logs/worker_<rank>.log,
   msrun's own log: <output>/logs/msrun.log. One worker runs `labkit train` directly (no msrun, no scheduler).
   With several nodes sharing <output>, each node writes <output>/launch_node<R>.yaml and <output>/logs/node<R>/,
   and only node 0 writes run-level files; a loopback master is refused (msrun would start a scheduler per node).
3. Shows progress from rank 0's <output>/metrics.jsonl and watches the worker processes itself: when one exits
   non-zero, every process of the job is ended at once (the survivors would otherwise wait in a collective until a
   timeout), and the report names the rank and shows the tail of its log. The same happens on KeyboardInterrupt
   (a notebook's interrupt button), and a small guard process ends the job if the launcher itself dies.
   The watching is `supervisor.Supervisor.poll()`, one look returning an Outcome; it also reads the scheduler's
   word on another node (never joined within parallel.cluster_timeout_s, or its heartbeat stopped) and names it.

msrun puts each worker in its own session (`setsid`), so ending msrun's process group does not end the workers;
the launcher records every process of the job (pid + start time) and ends each one.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.config import dump_run_config
from labkit.io import OutputLock, atomic_write_text
from labkit.launch.supervisor import (
    CLUSTER_NOT_GATHERED,
    FINISHED,
    TIMEOUT,
    Job,
    Outcome,
    Supervisor,
    interrupt_flag,
    log_tail,
    start_guard,
    summary_from_log,
    supervise,
)
from labkit.launch.validate import LaunchSpec, PreparedLaunch, cluster_timeout, command, node_files, prepare
from labkit.launch.workers import job_env
from labkit.output import add_common_flags, emit
from labkit.training import checkpoint
from labkit.training.fault import Fault, check_fault
from labkit.training.metrics import read_metrics, rewrite_metrics
from labkit.training.oom import memory_knobs
from labkit.training.trainer import add_train_flags


@dataclass
class LaunchResult:
    """What a launch did. `ok` is True when every worker exited 0."""

    ok: bool
    returncode: int  # 0, or the failed worker's exit code (negative = killed by that signal), or 1
    workers: int
    output: str
    metrics: str  # rank 0's metrics.jsonl (loss averaged over ranks)
    logs: str  # folder with worker_<rank>.log (and msrun.log)
    failed_rank: int | None = None
    reason: str | None = None  # why it failed, in one sentence
    log_tail: str = ""  # the end of the failed rank's log
    steps_done: int = 0  # last step rank 0 logged
    checkpoint: str | None = None  # newest complete checkpoint in output
    summary: dict | None = None  # rank 0's `labkit train --json` summary, when it finished
    seconds: float = 0.0
    stop_seconds: float | None = None  # from the first worker's death to every process of the job ended
    master_port: int | None = None
    command: list = field(default_factory=list)
    pids: list = field(default_factory=list)  # every process of the job (msrun, scheduler, workers), for audits
    survivors: list = field(default_factory=list)  # processes of the job still alive after the launcher ended it

    def to_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        if self.ok:
            s = self.summary or {}
            line = f"{self.workers} worker(s) trained to step {self.steps_done}"
            if s.get("final_loss") is not None:
                line += (f": loss {s['first_loss']:.4f} → {s['final_loss']:.4f}, "
                         f"{s['tokens_per_s']:.0f} tokens/s (global batch {s['global_batch']})")
            return f"{line}\nmetrics: {self.metrics}\ncheckpoint: {self.checkpoint}\nlogs: {self.logs}"
        ended = ("every process of the job was ended" if not self.survivors
                 else f"processes {self.survivors} could not be ended")
        text = [f"FAILED: {self.reason}", f"{ended}; logs: {self.logs}"]
        if self.log_tail:
            where = f"rank {self.failed_rank}" if self.failed_rank is not None else "msrun"
            text += [f"--- last lines of {where}'s log ---", self.log_tail, "---"]
        text.append(f"last complete checkpoint: {self.checkpoint} (continue with --resume)" if self.checkpoint
                    else "no complete checkpoint was written")
        return "\n".join(text)

    def __str__(self) -> str:
        return self.report()


@dataclass(frozen=True)
class LaunchFiles:
    """What a launch wrote before starting: this node's config and log folder, and the command."""

    output: Path
    logs: Path  # this node's log folder
    config_file: Path
    metrics: Path  # rank 0's metrics.jsonl
    command: tuple


def launch(spec: LaunchSpec = LaunchSpec(), *, progress: bool = True, timeout: float | None = None,
           kill_rank: int | None = None, kill_after_step: int = 1, log=None, show_report: bool = True) -> LaunchResult:
    """Validate, start `labkit train` on the spec's workers (x nodes), watch, and return a LaunchResult.

    `kill_rank`/`kill_after_step` are a fault drill: that rank ends itself with SIGKILL right after that step
    (injected inside the worker, so where the run stops never depends on how fast this launcher looks).
    `timeout` (seconds) ends the job as failed when it runs longer. Every process is ended before returning,
    also on KeyboardInterrupt (which is then re-raised)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    pl = prepare(spec)
    fault = check_fault(kill_rank, kill_after_step, pl.total, pl.start_step, pl.cfg.train.steps)
    lock = OutputLock(Path(pl.output), pl.node_rank, "labkit launch").acquire()  # before --overwrite clears anything
    try:
        files = write_files(pl, spec.overwrite, fault)
        log(f"launching {pl.total} worker(s) ({pl.mode}, dp={pl.dp}, global batch {pl.global_batch}); logs in "
            f"{files.logs}")
        if fault is not None:
            log(f"fault drill: rank {fault.rank} will end itself with SIGKILL right after step {fault.after_step}")
        log(" ".join(files.command))
        sup = guard = watch = outcome = None
        try:  # an interrupt at any moment from here on ends what was started: none is left behind
            with interrupt_flag() as interrupted:
                sup, guard = start(pl, files, timeout, fault)
                watch = Watch(pl, files, progress)
                outcome = supervise(sup, watch.tick, interrupted)
        finally:
            if watch is not None:
                watch.close()
            if outcome is not None and outcome.state == FINISHED and not pl.total == 1:
                sup.wait_root(30)  # msrun ends by itself once its scheduler is done
            survivors = sup.stop() if sup is not None else []
            if guard is not None:
                guard.kill()
                guard.wait()
    finally:
        lock.release()
    result = report(pl, files, sup, outcome, watch.steps_seen)
    result.survivors = survivors
    if show_report:
        log(result.report())
    return result


def write_files(pl: PreparedLaunch, overwrite: bool, fault: Fault | None = None) -> LaunchFiles:
    """Node 0 clears an overwritten run and trims a resumed run's metrics; every node writes its own config."""
    out = Path(pl.output)
    config_file, logs = node_files(pl)
    if pl.node_rank == 0 and not pl.resume and overwrite:
        _clear_run(out)
    if pl.node_rank == 0 and pl.resume:  # what `labkit train --resume` does first; progress then starts there
        rewrite_metrics(out, [r for r in read_metrics(out) if r.get("step", 0) <= pl.start_step])
    logs.mkdir(parents=True, exist_ok=True)
    for old in [logs / "scheduler.log", *logs.glob("worker_*.log")]:  # msrun overwrites them once it starts its
        old.unlink(missing_ok=True)  # processes; until then the supervisor must not read a previous run's words
    atomic_write_text(config_file, dump_run_config(pl.cfg))
    return LaunchFiles(output=out, logs=logs, config_file=config_file, metrics=out / "metrics.jsonl",
                       command=tuple(command(pl, config_file, logs) + fault_args(fault)))


def start(pl: PreparedLaunch, files: LaunchFiles, timeout: float | None, fault: Fault | None = None):
    """Start the job's root process (msrun, or the single worker) in its own session, and the guard."""
    single = pl.total == 1
    started = time.perf_counter()
    sink = open(files.logs / ("worker_0.log" if single else "msrun.log"), "w", encoding="utf-8")
    env = job_env(files.logs, pl.cfg.parallel.device_target)
    root = subprocess.Popen(list(files.command), env=env, stdin=subprocess.DEVNULL, stdout=sink,
                            stderr=subprocess.STDOUT, start_new_session=True)
    sink.close()
    try:
        sup = Supervisor(root, single=single, first_rank=pl.node_rank * pl.workers, workers=pl.workers,
                         msrun_log=files.logs / "msrun.log", timeout=timeout, started=started,
                         drill_rank=fault.rank if fault else None)
        return sup, start_guard(root.pid)
    except BaseException:  # interrupted before the caller could watch the job: end every process it has
        Job(root, single, pl.node_rank * pl.workers).kill_all()
        raise


def fault_args(fault: Fault | None) -> list[str]:
    """The worker flags of a fault drill (`labkit train --kill-rank R --kill-after-step K`)."""
    return [] if fault is None else ["--kill-rank", str(fault.rank), "--kill-after-step", str(fault.after_step)]


class Watch:
    """After each look at the job: progress from rank 0's metrics (node 0 only)."""

    def __init__(self, pl, files, progress):
        self.pl, self.files = pl, files
        self.steps_seen = pl.start_step
        self.bar = _bar(pl, progress)

    def tick(self):
        rows = read_metrics(self.files.output)  # the shared folder: every node sees rank 0's steps
        if rows and rows[-1].get("step", 0) > self.steps_seen:
            self.steps_seen = rows[-1]["step"]
            if self.bar is not None:
                self.bar.update(self.steps_seen - self.bar.n)
                self.bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}", refresh=False)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def report(pl: PreparedLaunch, files: LaunchFiles, sup: Supervisor, outcome: Outcome, steps_seen: int) -> LaunchResult:
    """The LaunchResult of an ended job: figures, newest checkpoint, and on failure who, why and the log tail."""
    logs = files.logs
    result = LaunchResult(ok=False, returncode=1, workers=pl.total, output=str(files.output),
                          metrics=str(files.metrics), logs=str(logs), master_port=pl.master_port,
                          command=list(files.command), pids=sup.pids)
    result.seconds = time.perf_counter() - sup.started
    result.steps_done = max([steps_seen] + [r.get("step", 0) for r in read_metrics(files.output)])
    ck = checkpoint.latest(files.output)
    result.checkpoint = str(ck) if ck else None
    first_rank = pl.node_rank * pl.workers
    result.summary = summary_from_log(logs / f"worker_{first_rank}.log") if pl.node_rank == 0 else None
    if outcome.state != FINISHED:
        result.stop_seconds = time.perf_counter() - (outcome.first_death or time.perf_counter())
        result.failed_rank = outcome.rank
        result.returncode = outcome.code if outcome.code else 1
        result.reason = missing_nodes(pl, outcome) or outcome.reason or failure_reason(pl, sup, outcome,
                                                                                         result.steps_done)
        if outcome.state == TIMEOUT:
            result.reason += f" (step {result.steps_done})"
        own = logs / f"worker_{outcome.rank}.log"  # a rank of another node has its log there, not here
        if outcome.rank is None or not own.exists():
            by_rank = outcome.rank is not None or outcome.state == TIMEOUT or outcome.reason is not None
            own = logs / f"worker_{first_rank}.log" if by_rank else logs / "msrun.log"
        result.log_tail = log_tail(own)
    elif pl.node_rank == 0 and not (result.summary or {}).get("ok"):
        result.failed_rank = 0
        result.reason = "rank 0 ended without its summary line"
        result.log_tail = log_tail(logs / "worker_0.log")
    else:
        result.ok, result.returncode = True, 0
    return result


def failure_reason(pl: PreparedLaunch, sup: Supervisor, outcome: Outcome, steps_done: int) -> str:
    """One sentence: which rank (or msrun, or a node that never joined) ended how, after how many steps. A rank that
    ran out of memory (its memory cgroup counted an OOM kill since the rank started, the kernel log names its pid,
    or its log ends in an allocator's failure) is named so, with its limit, and a second line gives the knobs to
    turn with the planner's figures; any other SIGKILL the launcher did not send says what was checked."""
    code, rank = outcome.code or 1, outcome.rank
    how = f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how = f"was killed by signal {signal.Signals(-code).name} (exit {code})"
    if rank is None:
        return f"msrun {how} after {steps_done} of {pl.cfg.train.steps} steps"
    text = f"rank {rank} (pid {sup.ranks[rank].pid}) {how} after {steps_done} of {pl.cfg.train.steps} steps"
    death = sup.memory_death(rank, code)
    if death and death["out_of_memory"]:
        return f"{text}: out of memory, {death['how']}: {death['evidence']}\n{memory_knobs(pl.cfg, death['limit_mb'])}"
    if death and death["out_of_memory"] is None:  # a SIGKILL from outside that no memory record explains
        return f"{text}, not sent by the launcher: {death['how']} ({death['evidence']})"
    return text


def missing_nodes(pl: PreparedLaunch, outcome: Outcome) -> str | None:
    """When the cluster never gathered: the nodes (and their ranks) that did not join, by name. Node 0 sees only
    its own workers, so it names every other node; another node names node 0, whose scheduler it never reached."""
    if outcome.reason != CLUSTER_NOT_GATHERED:
        return None
    ranks = lambda n: f"rank {n * pl.workers}" if pl.workers == 1 else \
        f"ranks {n * pl.workers}..{(n + 1) * pl.workers - 1}"  # noqa: E731
    others = [n for n in range(pl.nodes) if n != pl.node_rank] if pl.node_rank == 0 else [0]
    names = ", ".join(f"node {n} ({ranks(n)})" for n in others)
    waited = f"within parallel.cluster_timeout_s = {cluster_timeout(pl.cfg)} s"
    if pl.nodes == 1:
        return f"the {pl.total} workers of this machine did not gather {waited}"
    return (f"{names} never joined the cluster {waited} (this is node {pl.node_rank}); start every node with the "
            f"same --nodes, --master-addr and --master-port, and check that node {0 if pl.node_rank else 1} can "
            f"reach {pl.master_addr}:{pl.master_port}")


def _clear_run(out: Path):
    import shutil

    for name in ("checkpoints", "logs"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "config.yaml", "launch.yaml", "strategy.ckpt"):
        (out / name).unlink(missing_ok=True)


def _bar(pl: PreparedLaunch, enabled: bool):
    if not enabled or pl.node_rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=pl.cfg.train.steps, initial=pl.start_step, unit="step", file=sys.stderr,
                desc=f"rank 0 of {pl.total}")


# ---------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes on this node (default 2)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job; run the same command on each")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's number, 0..nodes-1")
    parser.add_argument("--master-addr", help="host of node 0 (needed with --nodes > 1)")
    parser.add_argument("--master-port", type=int, help="scheduler port (default: a free one on this machine)")
    add_train_flags(parser)
    parser.add_argument("--overwrite", action="store_true", help="start over in an --output that holds a run")
    parser.add_argument("--timeout", type=float, help="end the job as failed after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the command, start nothing")
    add_common_flags(parser, "print one JSON object (the launch result)")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    spec = LaunchSpec(args.config, args.workers, args.set, output=args.output, nodes=args.nodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      resume=args.resume, overwrite=args.overwrite, steps=args.steps, micro_batch=args.micro_batch,
                      accum=args.accum, seed=args.seed)
    if args.dry_run:
        pl = prepare(spec)
        fault = check_fault(args.kill_rank, args.kill_after_step, pl.total, pl.start_step, pl.cfg.train.steps)
        cmd = command(pl, *node_files(pl)) + fault_args(fault)
        payload = {"ok": True, "workers": pl.total, "parallel_mode": pl.mode, "dp": pl.dp,
                   "global_batch": pl.global_batch, "dataset": pl.dataset, "output": pl.output,
                   "master_port": pl.master_port, "command": cmd}
        emit(args, payload, " ".join(cmd))
        return 0
    quiet = getattr(args, "json", False)
    res = launch(spec, progress=not quiet, timeout=args.timeout, kill_rank=args.kill_rank,
                 kill_after_step=args.kill_after_step, show_report=False)
    emit(args, res.to_dict(), res.report())
    return 0 if res.ok else 1
