"""Everything a launch checks before any process starts (config, layout, batch arithmetic, dataset, output folder,
port), resolved into a PreparedLaunch, and the msrun command that starts it."""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from labkit.errors import LabkitError


# variables msrun sets for its workers; a launch from inside a worker must not inherit them
CLUSTER_ENV = ("MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_ROLE", "MS_NODE_ID", "MS_TOPO_TIMEOUT",
               "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_SIMULATION_LEVEL")


NO_TAIL = "65535"  # --tail_worker_log value naming no rank: msrun copies no worker log into its own output


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


def resolve_config(config, overrides=(), *, steps=None, micro_batch=None, accum=None, seed=None, output=None):
    """A RunConfig from a YAML path or a RunConfig, with `a.b=c` overrides and the train flags applied."""
    from labkit.config import RunConfig, load, load_run_config, set_dotted, to_dict

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


def prepare(config="configs/tiny_cpu.yaml", workers: int = 2, overrides=(), *, output=None, nodes: int = 1,
         node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None, resume: bool = False,
         overwrite: bool = False, steps=None, micro_batch=None, accum=None, seed=None) -> PreparedLaunch:
    """Validate a launch without starting anything (the dataset is built here on first use)."""
    from labkit.training import checkpoint
    from labkit.data import dataset as data
    from labkit.data import loader
    from labkit.parallel import context as parallel
    from labkit.training.world import World, check_batch, dp_size

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
        dataset = data.ensure_dataset(cfg.data.seq_len, corpus=cfg.data.corpus, tokenizer_dir=cfg.data.tokenizer,
                                      val_fraction=cfg.data.val_fraction, val_seed=cfg.data.val_seed)
    stats = data.read_stats(dataset)
    if stats.get("seq_len") not in (None, cfg.data.seq_len):
        raise LabkitError(f"dataset {dataset} holds samples of seq_len {stats['seq_len']}, the config asks for "
                          f"{cfg.data.seq_len}", "set data.seq_len to match or rebuild the dataset")
    vocab = cfg.model_config().vocab_size
    if stats.get("vocab_size") and stats["vocab_size"] > vocab:
        raise LabkitError(f"dataset tokenizer has {stats['vocab_size']} tokens, the model's vocab_size is {vocab}",
                          "use the matching tokenizer or resize the embeddings")
    loader.check_layout(stats["n_samples"], cfg.train.micro_batch, dp, 0, cfg.train.accum)
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
    return PreparedLaunch(cfg=cfg, workers=workers, nodes=nodes, node_rank=node_rank, total=total, mode=mode, dp=dp,
                      global_batch=global_batch, dataset=cfg.data.dataset, output=str(out),
                      master_addr=addr if total > 1 else None, master_port=master_port, resume=resume,
                      start_step=start)


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


def command(pl: PreparedLaunch, config_file: Path, logs: Path) -> list[str]:
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
