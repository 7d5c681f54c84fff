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
3. Shows progress from rank 0's <output>/metrics.jsonl and watches the worker processes itself: when one exits
   non-zero, every process of the job is ended at once (the survivors would otherwise wait in a collective until a
   timeout), and the report names the rank and shows the tail of its log. The same happens on KeyboardInterrupt
   (a notebook's interrupt button), and a small guard process ends the job if the launcher itself dies.

msrun puts each worker in its own session (`setsid`), so ending msrun's process group does not end the workers;
the launcher records every process of the job (pid + start time) and ends each one.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.training.metrics import read_metrics
from labkit.launch.validate import CLUSTER_ENV, PreparedLaunch, command, prepare, python_on_path
from labkit.launch.supervisor import EXIT_REPORT_S, FINISH_GRACE_S, Job, MSRUN_WORKER_ERROR, POLL_S, log_tail, read_log, start_guard, summary_from_log


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
        ended = (f"every process of the job was ended" if not self.survivors
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


# ---------------------------------------------------------------------------------------------- validation


# ---------------------------------------------------------------------------------------------- running


def launch(config="configs/tiny_cpu.yaml", workers: int = 2, overrides=(), *, output=None, nodes: int = 1,
           node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
           resume: bool = False, overwrite: bool = False, steps=None, micro_batch=None, accum=None, seed=None,
           progress: bool = True, timeout: float | None = None, kill_rank: int | None = None,
           kill_after_step: int = 1, log=None, show_report: bool = True) -> LaunchResult:
    """Validate, start `labkit train` on `workers` processes (x `nodes`), watch, and return a LaunchResult.

    `kill_rank`/`kill_after_step` are a fault drill: SIGKILL that rank once rank 0 has logged that step.
    `timeout` (seconds) ends the job as failed when it runs longer. Every process is ended before returning,
    also on KeyboardInterrupt (which is then re-raised)."""
    from labkit.config import dump_run_config
    from labkit.paths import RUNS
    from labkit.io import OutputLock, atomic_write_text

    log = log or (lambda m: print(m, file=sys.stderr))
    pl = prepare(config, workers, overrides, output=output, nodes=nodes, node_rank=node_rank,
              master_addr=master_addr, master_port=master_port, resume=resume, overwrite=overwrite, steps=steps,
              micro_batch=micro_batch, accum=accum, seed=seed)
    out = Path(pl.output)
    lock = OutputLock(out, pl.node_rank, "labkit launch").acquire()  # before --overwrite clears anything
    logs = out / "logs"
    if not resume and overwrite:
        _clear_run(out)
    if resume:  # what `labkit train --resume` does first; done here so progress does not show the dead run's steps
        from labkit.training.metrics import rewrite_metrics

        rewrite_metrics(out, [r for r in read_metrics(out) if r.get("step", 0) <= pl.start_step])
    logs.mkdir(parents=True, exist_ok=True)
    config_file = atomic_write_text(out / "launch.yaml", dump_run_config(pl.cfg))
    cmd = command(pl, config_file, logs)
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}
    env.setdefault("GLOG_v", "3")  # quiet MindSpore; mindformers' file logs go under runs/, not ./output
    env.setdefault("LOG_MF_PATH", str(RUNS / "logs" / "mindformers"))
    env.setdefault("TQDM_MININTERVAL", "5")
    env.setdefault("MS_OM_PATH", str(logs))  # a failed graph compile writes rank_N/om/analyze_fail.ir here, not ./
    env = python_on_path(env, logs / ".bin")
    first_rank = pl.node_rank * pl.workers
    single = pl.total == 1
    metrics = out / "metrics.jsonl"
    log(f"launching {pl.total} worker(s) ({pl.mode}, dp={pl.dp}, global batch {pl.global_batch}); logs in {logs}")
    log(" ".join(cmd))

    started = time.perf_counter()
    sink = open(logs / ("worker_0.log" if single else "msrun.log"), "w", encoding="utf-8")
    root = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                            start_new_session=True)
    sink.close()
    job = Job(root, single, first_rank)
    guard = start_guard(root.pid)
    bar = _bar(pl, progress)
    result = LaunchResult(ok=False, returncode=1, workers=pl.total, output=str(out), metrics=str(metrics),
                          logs=str(logs), master_port=pl.master_port, command=cmd)
    steps_seen, killed, failed_at, first_death = pl.start_step, None, None, None
    ended_at: dict[int, float] = {}
    try:
        while True:
            time.sleep(POLL_S)
            job.refresh()
            rows = read_metrics(out) if (pl.node_rank == 0) else []
            if rows and rows[-1].get("step", 0) > steps_seen:
                steps_seen = rows[-1]["step"]
                if bar is not None:
                    bar.update(steps_seen - bar.n)
                    bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}", refresh=False)
            if kill_rank is not None and not killed and steps_seen >= kill_after_step and kill_rank in job.ranks:
                log(f"fault drill: SIGKILL to rank {kill_rank} (pid {job.ranks[kill_rank].pid}) after step "
                    f"{steps_seen}")
                os.kill(job.ranks[kill_rank].pid, signal.SIGKILL)
                killed = time.perf_counter()
            now = time.perf_counter()
            failure = None
            if single:
                code = root.poll()
                if code is not None:
                    first_death = killed or now
                    if code != 0:
                        failure = (first_rank, code)
                    break
            else:
                codes = {int(pid): int(c) for pid, c in MSRUN_WORKER_ERROR.findall(read_log(logs / "msrun.log"))}
                by_pid = {p.pid: r for r, p in job.ranks.items()}
                bad = [(by_pid.get(pid), c) for pid, c in codes.items()]
                for r, p in job.ranks.items():
                    if job.ended(p):
                        ended_at.setdefault(r, now)
                first_death = killed or (min(ended_at.values()) if ended_at else None)
                if bad:
                    failure = bad[0]
                elif root.poll() is not None:  # msrun ended: 0 = it saw every worker exit 0
                    if root.returncode == 0:
                        break
                    failure = (None, root.returncode)  # msrun itself gave up (bad arguments, cluster timeout)
                elif len(ended_at) == pl.workers and all(now - t > EXIT_REPORT_S for t in ended_at.values()):
                    break  # every worker exited 0; msrun may still wait for its scheduler
                elif ended_at and now - min(ended_at.values()) > FINISH_GRACE_S:
                    failure = (None, 1)
                    result.reason = (f"ranks {sorted(set(job.ranks) - set(ended_at))} still running "
                                     f"{FINISH_GRACE_S:.0f} s after rank {min(ended_at, key=ended_at.get)} finished")
            if failure is None and timeout is not None and now - started > timeout:
                failure = (None, 1)
                result.reason = f"timed out after {timeout:g} s (step {steps_seen})"
            if failure is not None:
                failed_at = first_death or time.perf_counter()
                result.failed_rank, result.returncode = failure
                break
    except BaseException:
        job.kill_all()
        raise
    finally:
        if bar is not None:
            bar.close()
        if failed_at is None and not single:
            deadline = time.perf_counter() + 30
            while root.poll() is None and time.perf_counter() < deadline:
                time.sleep(POLL_S)
        job.kill_all()
        if guard is not None:
            guard.kill()
            guard.wait()
        result.pids = sorted(job.procs)
        result.survivors = sorted(p.pid for p in job.alive())
        lock.release()
    from labkit.training import checkpoint

    result.seconds = time.perf_counter() - started
    result.steps_done = max([steps_seen] + [r.get("step", 0) for r in read_metrics(out)])
    ck = checkpoint.latest(out)
    result.checkpoint = str(ck) if ck else None
    result.summary = summary_from_log(logs / "worker_0.log") if pl.node_rank == 0 else None
    if failed_at is not None:
        result.stop_seconds = time.perf_counter() - failed_at
        result.ok = False
        rank = result.failed_rank
        if result.reason is None:
            code = result.returncode
            how = f"exited with code {code}"
            if code < 0:
                with contextlib.suppress(ValueError):
                    how = f"was killed by signal {signal.Signals(-code).name} (exit {code})"
            who = f"rank {rank} (pid {job.ranks[rank].pid})" if rank is not None else "msrun"
            result.reason = f"{who} {how} after {result.steps_done} of {pl.cfg.train.steps} steps"
        own = logs / f"worker_{rank if rank is not None else first_rank}.log"
        result.log_tail = log_tail(own if rank is not None or result.reason.startswith(("timed", "ranks"))
                                   else logs / "msrun.log")
        if result.returncode == 0:
            result.returncode = 1
    elif pl.node_rank == 0 and not (result.summary or {}).get("ok"):
        result.ok, result.returncode, result.failed_rank = False, 1, 0
        result.reason = "rank 0 ended without its summary line"
        result.log_tail = log_tail(logs / "worker_0.log")
    else:
        result.ok, result.returncode = True, 0
    if show_report:
        log(result.report())
    return result


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


# ------------------------------------------------------------------------------------- comparing runs


# ------------------------------------------------------------------------------------ communication probe


# ---------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    from labkit.training.trainer import add_train_flags

    parser.add_argument("--workers", type=int, default=2, help="worker processes on this node (default 2)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job; run the same command on each")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's number, 0..nodes-1")
    parser.add_argument("--master-addr", help="host of node 0 (needed with --nodes > 1)")
    parser.add_argument("--master-port", type=int, help="scheduler port (default: a free one on this machine)")
    add_train_flags(parser)
    parser.add_argument("--overwrite", action="store_true", help="start over in an --output that holds a run")
    parser.add_argument("--timeout", type=float, help="end the job as failed after this many seconds")
    parser.add_argument("--kill-rank", type=int, help="fault drill: SIGKILL this rank ...")
    parser.add_argument("--kill-after-step", type=int, default=1, help="... once rank 0 has logged this step")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the command, start nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the launch result)")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    from labkit.output import emit

    kw = dict(overrides=args.set, output=args.output, nodes=args.nodes, node_rank=args.node_rank,
              master_addr=args.master_addr, master_port=args.master_port, resume=args.resume,
              overwrite=args.overwrite, steps=args.steps, micro_batch=args.micro_batch, accum=args.accum,
              seed=args.seed)
    if args.dry_run:
        pl = prepare(args.config, args.workers, **kw)
        cmd = command(pl, Path(pl.output) / "launch.yaml", Path(pl.output) / "logs")
        payload = {"ok": True, "workers": pl.total, "parallel_mode": pl.mode, "dp": pl.dp,
                   "global_batch": pl.global_batch, "dataset": pl.dataset, "output": pl.output,
                   "master_port": pl.master_port, "command": cmd}
        emit(args, payload, " ".join(cmd))
        return 0
    quiet = getattr(args, "json", False)
    res = launch(args.config, args.workers, progress=not quiet, timeout=args.timeout, kill_rank=args.kill_rank,
                 kill_after_step=args.kill_after_step, show_report=False, **kw)
    emit(args, res.to_dict(), res.report())
    return 0 if res.ok else 1
