"""Everything a launch checks before any process starts (config, placement of workers, batch arithmetic, dataset,
output folder, port), resolved into a PreparedLaunch, and the msrun command that starts it."""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.config import flag_values, load_run_config
from labkit.data import loader
from labkit.errors import LabkitError
from labkit.parallel import context as parallel
from labkit.parallel.msrun import NO_TAIL, Cluster, msrun_args, msrun_head
from labkit.training import run_dir
from labkit.training.world import World, check_batch, dp_size

# variables msrun sets for its workers; a launch from inside a worker must not inherit them
CLUSTER_ENV = ("MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_ROLE", "MS_NODE_ID", "MS_TOPO_TIMEOUT",
               "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_SIMULATION_LEVEL")


@dataclass
class PreparedLaunch:
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


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch: the run (a config file or RunConfig, `a.b=c` overrides, and the flags `labkit train` shares:
    steps, micro_batch, accum, seed, output) and where (workers on this node, nodes, this node's rank, node 0's
    address and scheduler port), and whether it resumes or starts over in an output folder holding a run."""

    config: object = "configs/tiny_cpu.yaml"  # a YAML path or a labkit.config.RunConfig
    workers: int = 2  # worker processes on this node
    overrides: tuple | list = ()  # `a.b=c` assignments
    output: str | Path | None = None
    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None  # None: a free one
    resume: bool = False
    overwrite: bool = False
    steps: int | None = None
    micro_batch: int | None = None
    accum: int | None = None
    seed: int | None = None


def resolve_config(spec: LaunchSpec):
    """The RunConfig of a launch: its config with the overrides, then the train flags, applied."""
    return load_run_config(spec.config or "configs/tiny_cpu.yaml", list(spec.overrides or []), flag_values(spec))


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


@dataclass(frozen=True)
class Placement:
    """How many workers run where, and where node 0's scheduler listens."""

    workers: int  # worker processes on this node
    nodes: int
    node_rank: int
    total: int  # workers on all nodes
    master_addr: str | None  # None for a single worker


@dataclass(frozen=True)
class Parallel:
    """The parallel mode the workers run and the batch arithmetic it implies."""

    mode: str
    dp: int
    global_batch: int


LOOPBACK_FIX = ("give node 0's address on a network every node reaches; to try several nodes on one machine, put "
                "each in its own network namespace joined by a veth pair (docs/multinode.md)")


def check_placement(workers: int, nodes: int, node_rank: int, master_addr: str | None,
                 master_port: int | None) -> Placement:
    """Worker and node counts, node rank, and a master address every node can use."""
    for name, v, low in (("workers", workers, 1), ("nodes", nodes, 1)):
        if not isinstance(v, int) or v < low:
            raise LabkitError(f"--{name} must be an integer >= {low}, got {v!r}")
    if not 0 <= node_rank < nodes:
        raise LabkitError(f"--node-rank {node_rank} is outside 0..{nodes - 1}", "number the nodes 0..M-1")
    if nodes > 1:
        if not master_addr:
            raise LabkitError("--nodes > 1 needs --master-addr (the host of node 0, reachable from every node)")
        if master_port is None:
            raise LabkitError("--nodes > 1 needs an explicit --master-port", "give every node the same free port")
        check_master_addr(master_addr, node_rank)
    total = workers * nodes
    return Placement(workers=workers, nodes=nodes, node_rank=node_rank, total=total,
                  master_addr=(master_addr or "127.0.0.1") if total > 1 else None)


def local_addresses() -> set[str]:
    """The IPv4/IPv6 addresses of this machine's (this network namespace's) interfaces."""
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def check_master_addr(master_addr: str, node_rank: int) -> str:
    """With several nodes, msrun decides that it runs the master (scheduler) when --master-addr is one of this
    machine's own addresses: a loopback master, or node 0's address given on another node of the same machine,
    would start a second scheduler. Refuse both before anything starts."""
    import ipaddress

    try:
        ip = socket.getaddrinfo(master_addr, None)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise LabkitError(f"--master-addr {master_addr} does not resolve to an address",
                          "give node 0's IP address or a host name every node resolves") from None
    why = ("msrun decides it is the master by --master-addr being one of its own addresses, so every node would "
           "start a scheduler")
    if ipaddress.ip_address(ip).is_loopback:
        raise LabkitError(f"--master-addr {master_addr} is a loopback address and --nodes > 1: {why} and the "
                          "other nodes could not reach it", LOOPBACK_FIX)
    if node_rank > 0 and ip in local_addresses():
        raise LabkitError(f"--master-addr {master_addr} is an address of this machine, but this is node "
                          f"{node_rank}, not node 0: {why}", LOOPBACK_FIX)
    return ip


def resolve_parallel(cfg, total: int) -> Parallel:
    """The parallel mode for `total` workers (more than one means data_parallel unless the config says otherwise),
    checked against the hardware, and global batch = micro_batch x dp x accum against train.global_batch."""
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
    return Parallel(mode=mode, dp=dp, global_batch=check_batch(cfg, dp))


def choose_port(placement: Placement, master_port: int | None) -> int | None:
    """The scheduler port: a given one must be valid (and free on node 0); none given = a free one."""
    if placement.total == 1:
        return None
    if master_port is None:
        return free_port()
    if not 1024 <= int(master_port) <= 65535:
        raise LabkitError(f"--master-port {master_port} is outside 1024..65535")
    if placement.node_rank == 0 and not port_is_free(int(master_port)):
        raise LabkitError(f"master port {master_port} is already in use on this machine",
                          "choose another --master-port, or leave it out to pick a free one")
    return int(master_port)


def prepare(spec: LaunchSpec) -> PreparedLaunch:
    """Validate a launch without starting anything (the dataset is built here on first use)."""
    s = spec
    placement = check_placement(s.workers, s.nodes, s.node_rank, s.master_addr, s.master_port)
    port = choose_port(placement, s.master_port)
    cfg = resolve_config(s)
    par = resolve_parallel(cfg, placement.total)
    cfg.parallel.parallel_mode = par.mode
    ds = run_dir.check_dataset(cfg)
    loader.check_layout(ds.n_samples, cfg.train.micro_batch, par.dp, 0, cfg.train.accum)
    cfg.data.dataset = str(ds.path)
    init = run_dir.check_init_checkpoint(cfg.train.init_checkpoint, cfg)  # its weights against the model config
    if init is not None:
        cfg.train.init_checkpoint = str(init)
    # the run folder is shared by the nodes and only node 0 writes run-level files: another node that starts
    # after node 0 has begun must not see node 0's fresh run as an old one (a resume still needs the checkpoint).
    # A resumed checkpoint must fit the config, the dataset and the global batch (run_dir.check_resume*)
    folder = run_dir.check_run_folder(cfg.output_dir, resume=s.resume, overwrite=s.overwrite or s.node_rank > 0,
                                      steps=cfg.train.steps, shared=s.nodes > 1,
                                      fit=run_dir.ResumeFit(cfg, dataset=ds, global_batch=par.global_batch))
    cfg.output_dir = str(folder.output)
    return PreparedLaunch(cfg=cfg, workers=s.workers, nodes=s.nodes, node_rank=s.node_rank, total=placement.total,
                          mode=par.mode, dp=par.dp, global_batch=par.global_batch, dataset=cfg.data.dataset,
                          output=str(folder.output), master_addr=placement.master_addr, master_port=port,
                          resume=s.resume, start_step=folder.start_step)


def python_on_path(env: dict, shim_dir: Path) -> dict:
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


def node_files(pl: PreparedLaunch) -> tuple[Path, Path]:
    """(resolved config file, log folder) of this node: <output>/launch.yaml and <output>/logs on one node;
    <output>/launch_node<R>.yaml and <output>/logs/node<R>/ with several, so nodes sharing the folder never
    write the same file."""
    out = Path(pl.output)
    if pl.nodes == 1:
        return out / "launch.yaml", out / "logs"
    return out / f"launch_node{pl.node_rank}.yaml", out / "logs" / f"node{pl.node_rank}"


def cluster_timeout(cfg) -> int:
    """parallel.cluster_timeout_s (seconds msrun's processes wait for the whole cluster to gather)."""
    return int(cfg.parallel.cluster_timeout_s)


def command(pl: PreparedLaunch, config_file: Path, logs: Path) -> list[str]:
    """The command line the launcher runs (msrun for more than one worker in all)."""
    args = ["train", "--config", str(config_file), "--json"] + (["--resume"] if pl.resume else [])
    if pl.total == 1:  # the entry msrun runs too: a worker the launcher watches, not `labkit train`'s own watcher
        return ["python", "-m", "labkit.launch"] + args
    cluster = Cluster(pl.total, pl.workers, master_port=pl.master_port, master_addr=pl.master_addr,
                      node_rank=pl.node_rank if pl.nodes > 1 else None, cluster_time_out=cluster_timeout(pl.cfg))
    head = msrun_args(cluster, log_dir=logs, tail_worker_log=NO_TAIL, head=msrun_head())
    return head + ["python", "-m", "labkit.launch"] + args
