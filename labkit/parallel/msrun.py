"""The msrun command line for a parallel layout: worker counts per node, master address and port, log folder."""
from __future__ import annotations

from labkit.errors import LabkitError


def msrun_command(strategy: dict, nodes: int = 1, *, node_rank: int = 0, master_addr: str = "127.0.0.1",
                  master_port: int = 8118, log_dir: str = "output/msrun_log",
                  script: str = "run_mindformer.py --config pretrain_llama2_7b.yaml --use_parallel True "
                                "--run_mode train") -> str:
    """The msrun line that starts this strategy's workers on one node (run it on every node with its rank)."""
    devices = strategy["dp"] * strategy["mp"] * strategy["pp"]
    if nodes < 1 or devices % nodes:
        raise LabkitError(f"{devices} devices do not split evenly over {nodes} nodes")
    local = devices // nodes
    multi = f" --master_addr={master_addr} --node_rank={node_rank}" if nodes > 1 else ""
    return (f"msrun --worker_num={devices} --local_worker_num={local}{multi} --master_port={master_port} "
            f"--log_dir={log_dir} --join=True {script}")
