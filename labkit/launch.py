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
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import LabkitError, LabkitFailure
from .metrics import read_metrics

# msrun's own report of a failed worker (mindspore/parallel/cluster/process_entity/_api.py, MindSpore 2.9)
MSRUN_WORKER_ERROR = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
# variables msrun sets for its workers; a launch from inside a worker must not inherit them
CLUSTER_ENV = ("MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_ROLE", "MS_NODE_ID", "MS_TOPO_TIMEOUT",
               "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_SIMULATION_LEVEL")
NO_TAIL = "65535"  # --tail_worker_log value naming no rank: msrun copies no worker log into its own output
POLL_S = 0.25  # how often the launcher looks at the workers
EXIT_REPORT_S = 3.0  # msrun polls every second; a worker gone this long without msrun's error line exited 0
FINISH_GRACE_S = 60.0  # after one rank finished cleanly, the others must finish within this


@dataclass
class LaunchPlan:
    """Everything validated before a process starts."""

    cfg: object  # labkit.config.RunConfig, with parallel_mode and data.dataset resolved
    workers: int  # worker processes on this node
    nodes: int
    node_rank: int
    total: int  # workers on all nodes
    mode: str  # parallel mode the workers run
    dp: int  # data-parallel size
    global_batch: int
    dataset: str
    output: str
    master_addr: str | None
    master_port: int | None
    resume: bool
    start_step: int  # the step training continues from (resume) or 0


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


def resolve_config(config, overrides=(), *, steps=None, micro_batch=None, accum=None, seed=None, output=None):
    """A RunConfig from a YAML path or a RunConfig, with `a.b=c` overrides and the train flags applied."""
    from .config import RunConfig, load, load_run_config, set_dotted, to_dict

    sets = list(overrides or [])
    for key, value in (("train.steps", steps), ("train.micro_batch", micro_batch), ("train.accum", accum),
                       ("train.seed", seed), ("output_dir", output)):
        if value is not None:
            sets.append(f"{key}={value}")
    if isinstance(config, RunConfig):
        data = to_dict(config)
        for item in sets:
            set_dotted(data, item)
        return load(RunConfig, data)
    return load_run_config(config or "configs/tiny_cpu.yaml", sets)


def port_is_free(port: int, host: str = "") -> bool:
    """True when a TCP server could listen on `port` now (TIME_WAIT leftovers do not count as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def plan(config="configs/tiny_cpu.yaml", workers: int = 2, overrides=(), *, output=None, nodes: int = 1,
         node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None, resume: bool = False,
         overwrite: bool = False, steps=None, micro_batch=None, accum=None, seed=None) -> LaunchPlan:
    """Validate a launch without starting anything (the dataset is built here on first use)."""
    from . import checkpoint, data, parallel
    from .train import World, check_batch, dp_size

    for name, v, low in (("workers", workers, 1), ("nodes", nodes, 1)):
        if not isinstance(v, int) or v < low:
            raise LabkitError(f"--{name} must be an integer >= {low}, got {v!r}")
    if not 0 <= node_rank < nodes:
        raise LabkitError(f"--node-rank {node_rank} is outside 0..{nodes - 1}", "number the nodes 0..M-1")
    if nodes > 1 and not master_addr:
        raise LabkitError("--nodes > 1 needs --master-addr (the host of node 0, reachable from every node)")
    if nodes > 1 and master_port is None:
        raise LabkitError("--nodes > 1 needs an explicit --master-port", "give every node the same free port")
    cfg = resolve_config(config, overrides, steps=steps, micro_batch=micro_batch, accum=accum, seed=seed,
                         output=output)
    total = workers * nodes
    p = cfg.parallel
    mode = p.parallel_mode or ("data_parallel" if total > 1 else "stand_alone")
    parallel.require_hardware(mode, p.device_target, total)
    if mode == "stand_alone" and total > 1:
        raise LabkitError(f"parallel.parallel_mode is stand_alone but {total} workers were asked for",
                          "set parallel.parallel_mode: data_parallel (or null) or use --workers 1")
    if mode != "stand_alone" and total < 2:
        raise LabkitError(f"parallel.parallel_mode {mode} needs at least 2 workers",
                          "use --workers 2 or more, or --set parallel.parallel_mode=stand_alone for one worker")
    dp = dp_size(cfg, World(0, total, mode))
    global_batch = check_batch(cfg, dp)
    p.parallel_mode = mode

    if cfg.data.dataset:
        dataset = Path(cfg.data.dataset) if Path(cfg.data.dataset).is_absolute() else data.lab_path(cfg.data.dataset)
        if not dataset.is_dir():
            raise LabkitError(f"data.dataset {cfg.data.dataset} not found (looked at {dataset.resolve()})",
                              "build it with `labkit data build ...`, fix the path, or set data.dataset: null to "
                              "build the shipped corpus on first use")
    else:
        dataset = data.ensure_dataset(cfg.data.seq_len, corpus=cfg.data.corpus, tokenizer_dir=cfg.data.tokenizer)
    stats = data.read_stats(dataset)
    if stats.get("seq_len") not in (None, cfg.data.seq_len):
        raise LabkitError(f"dataset {dataset} holds samples of seq_len {stats['seq_len']}, the config asks for "
                          f"{cfg.data.seq_len}", "set data.seq_len to match or rebuild the dataset")
    vocab = cfg.model_config().vocab_size
    if stats.get("vocab_size") and stats["vocab_size"] > vocab:
        raise LabkitError(f"dataset tokenizer has {stats['vocab_size']} tokens, the model's vocab_size is {vocab}",
                          "use the matching tokenizer or resize the embeddings")
    data._check_layout(stats["n_samples"], cfg.train.micro_batch, dp, 0, cfg.train.accum)
    cfg.data.dataset = str(Path(dataset).resolve())
    if cfg.train.init_checkpoint:
        init = Path(cfg.train.init_checkpoint).expanduser()
        if not init.exists():
            raise LabkitError(f"train.init_checkpoint {init} not found",
                              "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
        cfg.train.init_checkpoint = str(init.resolve())

    out = Path(cfg.output_dir).expanduser().resolve()
    cfg.output_dir = str(out)
    start = 0
    if resume:
        ck = checkpoint.latest(out)
        if ck is None:
            raise LabkitError(f"--resume: no complete checkpoint under {checkpoint.checkpoint_dir(out)}",
                              "run without --resume first, or point --output at the earlier run"
                              + ("; with several nodes the output folder must be storage every node shares"
                                 if nodes > 1 else ""))
        start = int(ck.name.split("_")[1])
        if start >= cfg.train.steps:
            raise LabkitError(f"--resume: the newest checkpoint is step {start}, already at train.steps "
                              f"{cfg.train.steps}", "raise --steps to train further")
    elif (checkpoint.list_checkpoints(out) or (out / "metrics.jsonl").exists()) and not overwrite:
        raise LabkitError(f"output {out} already holds a run", "continue it with --resume, start over with "
                          "--overwrite, or choose another --output")

    addr = master_addr or "127.0.0.1"
    if total > 1:
        if master_port is not None:
            if not 1024 <= int(master_port) <= 65535:
                raise LabkitError(f"--master-port {master_port} is outside 1024..65535")
            if node_rank == 0 and not port_is_free(int(master_port)):
                raise LabkitError(f"master port {master_port} is already in use on this machine",
                                  "choose another --master-port, or leave it out to pick a free one")
        else:
            master_port = free_port()
    else:
        master_port = None
    return LaunchPlan(cfg=cfg, workers=workers, nodes=nodes, node_rank=node_rank, total=total, mode=mode, dp=dp,
                      global_batch=global_batch, dataset=cfg.data.dataset, output=str(out),
                      master_addr=addr if total > 1 else None, master_port=master_port, resume=resume,
                      start_step=start)


def _python_on_path(env: dict, shim_dir: Path) -> dict:
    """PATH with the caller's interpreter first as `python` (msrun starts workers with the `python` on PATH)."""
    exe = Path(sys.executable)
    first = exe.parent
    candidate = first / "python"
    try:
        same = candidate.exists() and os.path.samefile(candidate, exe)
    except OSError:
        same = False
    if not same:  # e.g. a python3.11 without a `python` beside it: a one-line shim that execs it
        shim_dir.mkdir(parents=True, exist_ok=True)
        shim = shim_dir / "python"
        shim.write_text(f'#!/bin/sh\nexec "{exe}" "$@"\n', encoding="utf-8")
        shim.chmod(0o755)
        first = shim_dir
    env["PATH"] = os.pathsep.join([str(first), env.get("PATH", "")])
    return env


def command(pl: LaunchPlan, config_file: Path, logs: Path) -> list[str]:
    """The command line the launcher runs (msrun for more than one worker in all)."""
    args = ["train", "--config", str(config_file), "--json"] + (["--resume"] if pl.resume else [])
    if pl.total == 1:
        return ["python", "-m", "labkit"] + args
    task = ["python", "-m", "labkit.launch"] + args
    msrun = Path(sys.executable).parent / "msrun"
    head = [str(msrun)] if msrun.exists() else [sys.executable, "-m", "mindspore.parallel.cluster.run"]
    head += [f"--worker_num={pl.total}", f"--local_worker_num={pl.workers}", f"--master_addr={pl.master_addr}",
             f"--master_port={pl.master_port}"]
    if pl.nodes > 1:
        head.append(f"--node_rank={pl.node_rank}")
    head += [f"--log_dir={logs}", "--join=True", "--cluster_time_out=300", f"--tail_worker_log={NO_TAIL}"]
    return head + task


# ---------------------------------------------------------------------------------------------- running


class _Job:
    """The process tree of one launch: the root (msrun or the single worker) and everything below it."""

    def __init__(self, root: subprocess.Popen, single: bool, first_rank: int):
        import psutil

        self.root, self.single, self.first_rank = root, single, first_rank
        self.procs: dict[int, psutil.Process] = {}
        self.ranks: dict[int, psutil.Process] = {}  # rank -> worker process
        self.scheduler = None
        try:
            self.procs[root.pid] = psutil.Process(root.pid)
        except psutil.NoSuchProcess:
            pass
        if single:
            self.ranks[first_rank] = self.procs.get(root.pid)

    def refresh(self):
        import psutil

        root = self.procs.get(self.root.pid)
        if root is None:
            return
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        known = {p.pid for p in self.ranks.values() if p is not None} | {getattr(self.scheduler, "pid", None)}
        for c in children:
            self.procs.setdefault(c.pid, c)
            if self.single or c.pid in known:
                continue
            try:  # msrun's direct children, classified by the environment msrun gave them (re-read until exec)
                if c.ppid() != root.pid:
                    continue
                env = c.environ()
            except psutil.Error:
                continue
            if env.get("MS_ROLE") == "MS_WORKER" and (env.get("MS_NODE_ID") or env.get("RANK_ID")):
                self.ranks[int(env.get("MS_NODE_ID") or env["RANK_ID"])] = c
            elif env.get("MS_ROLE") == "MS_SCHED":
                self.scheduler = c

    @staticmethod
    def ended(p) -> bool:
        import psutil

        try:
            return (not p.is_running()) or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def alive(self) -> list:
        return [p for p in self.procs.values() if not self.ended(p)]

    def kill_all(self, timeout: float = 10.0):
        """SIGKILL every process of the job (each worker's own session group too) and wait until all are gone."""
        import psutil

        self.refresh()
        for p in list(self.ranks.values()) + ([self.scheduler] if self.scheduler else []):
            if p is not None and not self.ended(p):
                try:
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.root.poll() is None:
            try:
                os.killpg(self.root.pid, signal.SIGKILL)  # msrun, its scheduler and helpers (own session)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.alive():
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(list(self.procs.values()), timeout=timeout)
        try:
            self.root.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


_NOISE = re.compile(r" - (INFO|DEBUG|WARNING) - |^\[(INFO|DEBUG|WARNING)\]|^\s*$")


def log_tail(path: Path, lines: int = 15) -> str:
    """The informative end of a worker log: from its last Traceback, else its last lines (framework INFO dropped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return f"(no log at {path})"
    rows = [r.split("\r")[-1].rstrip() for r in raw.splitlines()]
    rows = [r for r in rows if not _NOISE.search(r)]
    tb = max((i for i, r in enumerate(rows) if r.startswith("Traceback")), default=None)
    if tb is not None:
        return "\n".join(rows[tb:][-40:])
    return "\n".join(rows[-lines:]) if rows else "(no error in the log: the process was ended from outside)"


def _summary_from_log(path: Path) -> dict | None:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _start_guard(job_root: int) -> subprocess.Popen | None:
    """A separate process that ends the job if this launcher dies without cleaning up (kernel killed)."""
    try:
        return subprocess.Popen([sys.executable, "-m", "labkit.launch", "guard", str(os.getpid()), str(job_root)],
                                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def launch(config="configs/tiny_cpu.yaml", workers: int = 2, overrides=(), *, output=None, nodes: int = 1,
           node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
           resume: bool = False, overwrite: bool = False, steps=None, micro_batch=None, accum=None, seed=None,
           progress: bool = True, timeout: float | None = None, kill_rank: int | None = None,
           kill_after_step: int = 1, log=None, show_report: bool = True) -> LaunchResult:
    """Validate, start `labkit train` on `workers` processes (x `nodes`), watch, and return a LaunchResult.

    `kill_rank`/`kill_after_step` are a fault drill: SIGKILL that rank once rank 0 has logged that step.
    `timeout` (seconds) ends the job as failed when it runs longer. Every process is ended before returning,
    also on KeyboardInterrupt (which is then re-raised)."""
    from .config import dump_run_config
    from .paths import RUNS, atomic_write_text

    log = log or (lambda m: print(m, file=sys.stderr))
    pl = plan(config, workers, overrides, output=output, nodes=nodes, node_rank=node_rank,
              master_addr=master_addr, master_port=master_port, resume=resume, overwrite=overwrite, steps=steps,
              micro_batch=micro_batch, accum=accum, seed=seed)
    out = Path(pl.output)
    logs = out / "logs"
    if not resume and overwrite:
        _clear_run(out)
    if resume:  # what `labkit train --resume` does first; done here so progress does not show the dead run's steps
        from .train import _rewrite_metrics

        _rewrite_metrics(out, [r for r in read_metrics(out) if r.get("step", 0) <= pl.start_step])
    logs.mkdir(parents=True, exist_ok=True)
    config_file = atomic_write_text(out / "launch.yaml", dump_run_config(pl.cfg))
    cmd = command(pl, config_file, logs)
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}
    env.setdefault("GLOG_v", "3")  # quiet MindSpore; mindformers' file logs go under runs/, not ./output
    env.setdefault("LOG_MF_PATH", str(RUNS / "logs" / "mindformers"))
    env.setdefault("TQDM_MININTERVAL", "5")
    env.setdefault("MS_OM_PATH", str(logs))  # a failed graph compile writes rank_N/om/analyze_fail.ir here, not ./
    env = _python_on_path(env, logs / ".bin")
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
    job = _Job(root, single, first_rank)
    guard = _start_guard(root.pid)
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
                codes = {int(pid): int(c) for pid, c in MSRUN_WORKER_ERROR.findall(_read(logs / "msrun.log"))}
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
    from . import checkpoint

    result.seconds = time.perf_counter() - started
    result.steps_done = max([steps_seen] + [r.get("step", 0) for r in read_metrics(out)])
    ck = checkpoint.latest(out)
    result.checkpoint = str(ck) if ck else None
    result.summary = _summary_from_log(logs / "worker_0.log") if pl.node_rank == 0 else None
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


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _clear_run(out: Path):
    import shutil

    for name in ("checkpoints", "logs"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "config.yaml", "launch.yaml", "strategy.ckpt"):
        (out / name).unlink(missing_ok=True)


def _bar(pl: LaunchPlan, enabled: bool):
    if not enabled or pl.node_rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=pl.cfg.train.steps, initial=pl.start_step, unit="step", file=sys.stderr,
                desc=f"rank 0 of {pl.total}")


def _guard(parent_pid: int, root_pid: int) -> None:
    """`python -m labkit.launch guard PARENT ROOT`: end ROOT's process tree if PARENT dies first."""
    import psutil

    try:
        parent, root = psutil.Process(parent_pid), psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return
    known = {root.pid: root}
    while True:
        try:
            for c in root.children(recursive=True):
                known.setdefault(c.pid, c)
        except psutil.Error:
            pass
        alive = [p for p in known.values() if not _Job.ended(p)]
        if not alive:
            return
        if not parent.is_running():
            for p in alive:
                try:
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.kill()
                except (OSError, psutil.Error):
                    pass
            return
        time.sleep(0.5)


# ------------------------------------------------------------------------------------- comparing runs


def _run_and_checkpoint(path) -> tuple[Path, Path | None]:
    """(run folder, checkpoint): a run folder gives its newest checkpoint; a checkpoint folder gives itself."""
    from . import checkpoint

    path = Path(path)
    if (path / "state.json").is_file():
        return path.parent.parent, path
    return path, checkpoint.latest(path)


def compare_runs(run_a, run_b) -> dict:
    """Losses (metrics.jsonl) and model weights (optimizer state excluded) of two runs: run folders (their newest
    checkpoints) or checkpoint folders (<run>/checkpoints/step_N)."""
    import numpy as np

    from . import checkpoint

    (run_a, ca), (run_b, cb) = _run_and_checkpoint(run_a), _run_and_checkpoint(run_b)
    ma, mb = (read_metrics(r) for r in (run_a, run_b))
    if not ma or not mb:
        raise LabkitError(f"no metrics.jsonl in {run_a if not ma else run_b}", "compare two finished runs")
    la = {r["step"]: r["loss"] for r in ma}
    lb = {r["step"]: r["loss"] for r in mb}
    steps = sorted(set(la) & set(lb))
    if ca is None or cb is None:
        raise LabkitError(f"no complete checkpoint in {run_a if ca is None else run_b}")
    wa, wb = checkpoint.load_weights(ca), checkpoint.load_weights(cb)
    if set(wa) != set(wb):
        raise LabkitError(f"the checkpoints hold different parameters: {sorted(set(wa) ^ set(wb))[:3]}")
    worst, max_diff, max_abs = None, 0.0, 0.0
    for name in wa:
        x, y = wa[name].asnumpy().astype(np.float64), wb[name].asnumpy().astype(np.float64)
        d = float(np.abs(x - y).max()) if x.size else 0.0
        max_abs = max(max_abs, float(np.abs(x).max()) if x.size else 0.0)
        if d >= max_diff:
            worst, max_diff = name, d
    return {"steps": steps, "loss_a": [la[s] for s in steps], "loss_b": [lb[s] for s in steps],
            "max_loss_diff": max((abs(la[s] - lb[s]) for s in steps), default=None),
            "checkpoint_a": str(ca), "checkpoint_b": str(cb), "parameters": len(wa),
            "max_weight_diff": max_diff, "worst_parameter": worst, "max_abs_weight": max_abs,
            "identical": max_diff == 0.0}


def steady_throughput(run) -> float | None:
    """Median tokens/s over the steps after the first (the first one carries graph compilation)."""
    import statistics

    rows = read_metrics(run)
    vals = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    return statistics.median(vals) if vals else None


# ------------------------------------------------------------------------------------ communication probe


def grad_shapes(model_cfg) -> list[tuple[int, ...]]:
    """Shapes of the Llama's trainable parameters (= its gradients), in mindformers' layout."""
    h, f, v = model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.vocab_size
    kv = model_cfg.kv_heads * model_cfg.head_dim
    shapes = [(v, h)]
    for _ in range(model_cfg.num_layers):
        shapes += [(h,), (h,), (h, h), (kv, h), (kv, h), (h, h), (f, h), (h, f), (f, h)]
    shapes.append((h,))
    if not model_cfg.tie_word_embeddings:
        shapes.append((v, h))
    return shapes


def measure_allreduce(model="tiny", workers: int = 2, sizes=(1_000, 100_000, 1_000_000, 4_000_000),
                      repeats: int = 10, output=None, timeout: float = 300,
                      env_vars=("NCCL_ALGO", "NCCL_IB_DISABLE", "HCCL_CONNECT_TIMEOUT")) -> dict:
    """Time MindSpore's gradient all-reduce between `workers` processes on this machine (msrun, mccl on CPU).

    Measures `nn.DistributedGradReducer(mean=True)` (what training uses) on zero tensors shaped like `model`'s
    gradients, and a single float32 buffer of each size in `sizes` (elements), the median of `repeats` timed
    calls each, after a warm-up and with ranks aligned before each call. Also reports the communication backend
    and which of the libraries the worker has loaded mention each of `env_vars` (a library that reads a variable
    holds its name)."""
    from .config import ModelConfig, model_preset
    from .paths import RUNS

    if workers < 2:
        raise LabkitError("measure_allreduce needs at least 2 workers")
    mcfg = model if isinstance(model, ModelConfig) else model_preset(model)
    out = Path(output) if output else RUNS / "probe" / f"allreduce_{workers}w"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec = out / "probe.json"
    result_file = out / "result.json"
    result_file.unlink(missing_ok=True)
    spec.write_text(json.dumps({"model": [list(s) for s in grad_shapes(mcfg)], "sizes": list(sizes),
                                "repeats": repeats, "result": str(result_file.resolve()),
                                "env_vars": list(env_vars)}), encoding="utf-8")
    msrun = Path(sys.executable).parent / "msrun"
    head = [str(msrun)] if msrun.exists() else [sys.executable, "-m", "mindspore.parallel.cluster.run"]
    cmd = head + [f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port()}",
                  f"--log_dir={logs.resolve()}", "--join=True", "--cluster_time_out=120",
                  f"--tail_worker_log={NO_TAIL}", "python", "-m", "labkit.launch", "probe", str(spec.resolve())]
    env = _python_on_path({k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}, logs / ".bin")
    env.setdefault("GLOG_v", "3")
    env.setdefault("MS_OM_PATH", str(logs.resolve()))
    with open(logs / "msrun.log", "w", encoding="utf-8") as sink:
        root = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job = _Job(root, False, 0)
    try:
        deadline = time.perf_counter() + timeout
        while root.poll() is None and time.perf_counter() < deadline:
            time.sleep(POLL_S)
            job.refresh()
            if MSRUN_WORKER_ERROR.search(_read(logs / "msrun.log")) or result_file.exists():
                break
        time.sleep(0.5)
    finally:
        job.kill_all()
    if not result_file.exists():
        raise LabkitFailure("the all-reduce probe did not finish", f"see {logs}:\n{log_tail(logs / 'worker_0.log')}")
    return json.loads(result_file.read_text(encoding="utf-8"))


def _loaded_libraries() -> list[Path]:
    """Shared libraries mapped into this process (Linux /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({Path(line.split()[-1]) for line in maps if ".so" in line.rsplit("/", 1)[-1]})


def _libraries_mentioning(libs: list[Path], name: str) -> list[str]:
    """Which of `libs` contain the string `name` (e.g. an environment variable they read)."""
    import mmap

    hits = []
    for lib in libs:
        try:
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name.encode()) != -1:
                    hits.append(lib.name)
        except (OSError, ValueError):
            pass
    return hits


def _probe(spec_file: str) -> None:
    """`python -m labkit.launch probe SPEC` under msrun: rank 0 writes the timings named in SPEC."""
    import statistics

    import numpy as np

    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    rank, size = get_rank(), get_group_size()
    from . import parallel

    parallel.set_parallel_context("data_parallel", device_num=size, init_communication=False)
    align_op = ops.AllReduce()

    @ms.jit
    def align(x):
        return align_op(x)

    one = ms.Tensor([1.0], ms.float32)

    def timed(shapes):
        params = ms.ParameterTuple(ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
                                   for i, s in enumerate(shapes))
        reducer = nn.DistributedGradReducer(params, mean=True, degree=size)
        grads = tuple(ms.Tensor(np.full(s, rank + 1.0, np.float32)) for s in shapes)

        @ms.jit
        def run(g):
            return reducer(g)

        check = float(run(grads)[0].asnumpy().ravel()[0])  # compile + warm-up; mean of 1..size
        seconds = []
        for _ in range(spec["repeats"]):
            align(one).asnumpy()
            t = time.perf_counter()
            res = run(grads)
            res[-1].asnumpy()
            seconds.append(time.perf_counter() - t)
        numel = int(sum(np.prod(s) for s in shapes))
        med = statistics.median(seconds)
        return {"tensors": len(shapes), "numel": numel, "mbytes": numel * 4 / 1e6, "median_s": med,
                "min_s": min(seconds), "algbw_gbps": numel * 4 / med / 1e9,
                "mean_ok": abs(check - (size + 1) / 2) < 1e-6}

    model = timed([tuple(s) for s in spec["model"]])
    sweep = [timed([(int(n),)]) for n in spec["sizes"]]
    if rank == 0:
        from mindspore.communication import GlobalComm

        from .paths import atomic_write_text

        libs = _loaded_libraries()
        atomic_write_text(spec["result"], json.dumps({
            "workers": size, "backend": str(GlobalComm.BACKEND), "model_grads": model, "sizes": sweep,
            "loaded_libraries": [p.name for p in libs],
            "env_readers": {v: _libraries_mentioning(libs, v) for v in spec.get("env_vars", [])}}))
    align(one).asnumpy()


# ---------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    from .train import add_train_flags

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
    from .cli import emit

    kw = dict(overrides=args.set, output=args.output, nodes=args.nodes, node_rank=args.node_rank,
              master_addr=args.master_addr, master_port=args.master_port, resume=args.resume,
              overwrite=args.overwrite, steps=args.steps, micro_batch=args.micro_batch, accum=args.accum,
              seed=args.seed)
    if args.dry_run:
        pl = plan(args.config, args.workers, **kw)
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


def _task(argv: list[str]) -> int:
    """`python -m labkit.launch train ...` under msrun: `labkit train ...`, or just the scheduler's init()."""
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        os.environ.setdefault("GLOG_v", "3")
        from mindspore.communication import init

        init()  # the scheduler serves the workers until they finish
        return 0
    from .cli import main

    return main(["train", *argv])


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        sys.exit(_task(sys.argv[2:]))
    elif sys.argv[1:2] == ["guard"]:
        _guard(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["probe"]:
        _probe(sys.argv[2])
    else:
        sys.exit("usage: python -m labkit.launch train ARGS | guard PARENT_PID ROOT_PID | probe SPEC.json")
