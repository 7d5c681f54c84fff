"""The one msrun command builder: worker counts per node, master address and port, node rank, log folder, how long
the cluster waits for its members. `labkit launch`, the all-reduce probe, the tensor-parallel demo and the planner's
printed command all build their line here, so a flag is spelled once."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError

NO_TAIL = "65535"  # --tail_worker_log value naming no rank: msrun copies no worker log into its own output


def msrun_head(executable: str | None = None) -> list[str]:
    """How to start msrun with this interpreter: the `msrun` script beside it, else its module."""
    exe = Path(executable or sys.executable)
    script = exe.parent / "msrun"
    return [str(script)] if script.exists() else [str(exe), "-m", "mindspore.parallel.cluster.run"]


@dataclass(frozen=True)
class Cluster:
    """The processes msrun starts and how they find each other: workers in all and on this node, node 0's scheduler
    port and address, this node's rank, and how many seconds they wait for the whole cluster to gather.
    `master_addr` and `node_rank` are written when given (`node_rank` only matters with several nodes)."""

    worker_num: int
    local_worker_num: int
    master_port: int
    master_addr: str | None = None
    node_rank: int | None = None
    cluster_time_out: int | None = None


def msrun_args(cluster: Cluster, *, log_dir, tail_worker_log: str | None = None, head=("msrun",)) -> list[str]:
    """The msrun command line up to (not including) the task it starts on every process."""
    worker_num, local_worker_num = cluster.worker_num, cluster.local_worker_num
    master_addr, node_rank, cluster_time_out = cluster.master_addr, cluster.node_rank, cluster.cluster_time_out
    if worker_num < 1 or local_worker_num < 1 or worker_num % local_worker_num:
        raise LabkitError(f"msrun: {worker_num} workers do not split into nodes of {local_worker_num}",
                          "give a worker count that is a multiple of the workers per node")
    cmd = list(head) + [f"--worker_num={worker_num}", f"--local_worker_num={local_worker_num}"]
    if master_addr is not None:
        cmd.append(f"--master_addr={master_addr}")
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    cmd += [f"--master_port={cluster.master_port}", f"--log_dir={log_dir}", "--join=True"]
    if cluster_time_out is not None:
        cmd.append(f"--cluster_time_out={int(cluster_time_out)}")
    if tail_worker_log is not None:
        cmd.append(f"--tail_worker_log={tail_worker_log}")
    return cmd


def msrun_command(layout, nodes: int = 1, *, node_rank: int = 0, master_addr: str = "127.0.0.1",
                  master_port: int = 8118, log_dir: str = "output/msrun_log",
                  script: str = "run_mindformer.py --config pretrain_llama2_7b.yaml --use_parallel True "
                                "--run_mode train") -> str:
    """The msrun line that starts a layout's (labkit.layout.Layout) workers on one node (run it on every node with
    its rank)."""
    devices = layout.devices
    if nodes < 1 or devices % nodes:
        raise LabkitError(f"{devices} devices do not split evenly over {nodes} nodes")
    multi = nodes > 1
    cluster = Cluster(devices, devices // nodes, master_port=master_port, master_addr=master_addr if multi else None,
                      node_rank=node_rank if multi else None)
    args = msrun_args(cluster, log_dir=log_dir)
    return " ".join(args + [script])
