"""What a resolved run writes before anything starts: run.yaml (labkit), mindformers.yaml (the same run for
mindformers' run_mindformer.py), plan.json and launch.sh with the command for each node."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from labkit.config import dump_run_config
from labkit.course.pretrain.params import DEFAULTS
from labkit.course.pretrain.runspec import PretrainRun
from labkit.io import atomic_write_text
from labkit.launch.validate import PreparedLaunch, command
from labkit.parallel import mindformers_yaml as mf_yaml


def layout_table(run: PretrainRun, top: int = 8):
    """The chosen layout and the planner's next best ones as a DataFrame."""
    import pandas as pd

    rows = [run.strategy] + run.alternatives[:top - 1]
    return pd.DataFrame([{"chosen": r is run.strategy, "dp": r.dp, "mp": r.mp, "pp": r.pp,
                          "micro_batch": r.micro_batch, "accum": r.accum, "recompute": str(r.layout.recompute),
                          "optimizer_shard": r.optimizer_shard, "GiB/device": r.memory_gib["total"],
                          "fits": r.fits, "s/step": round(r.step_time_s, 3),
                          "tokens/s/device": round(r.tokens_per_s_per_device), "MFU": round(r.mfu, 3)}
                         for r in rows])


def mindformers_yaml(run: PretrainRun) -> str:
    """The same run as a mindformers run YAML (labkit.parallel.mindformers_yaml.run_yaml_text)."""
    memory = run.device_memory_gib - run.device.overhead_gib if run.cfg.parallel.device_target != "CPU" else None
    return mf_yaml.run_yaml_text(run.cfg, run.strategy.layout, model=run.model, devices=run.devices,
                                 max_device_memory_gib=memory, resume=run.resume,
                                 resume_from=run.resume_from and str(run.resume_from),
                                 src_strategy=run.resume_strategy and str(run.resume_strategy))


def commands(run: PretrainRun) -> dict:
    """The exact commands for this run: labkit launch per node, the msrun line it runs, mindformers', papermill's."""
    out, c = run.output_dir, run.cfg
    port = run.master_port or 8118
    addr = run.master_addr or ("NODE0_HOST" if run.nodes > 1 else "127.0.0.1")
    labkit = []
    for r in range(run.nodes):
        line = ["labkit", "launch", "--workers", str(run.workers), "--config", str(out / "run.yaml"),
                "--output", str(out)]
        if run.nodes > 1:
            line += ["--nodes", str(run.nodes), "--node-rank", str(r), "--master-addr", addr, "--master-port",
                     str(port)]
        if run.resume:
            line.append("--resume")
        labkit.append(shlex.join(line))
    pl = PreparedLaunch(cfg=c, workers=run.workers, nodes=run.nodes, node_rank=run.node_rank, total=run.devices,
                    mode=c.parallel.parallel_mode, dp=c.parallel.dp, global_batch=c.train.global_batch,
                    dataset=c.data.dataset or "", output=str(out), master_addr=addr if run.devices > 1 else None,
                    master_port=port if run.devices > 1 else None, resume=run.resume, start_step=0)
    msrun = shlex.join(command(pl, out / "launch.yaml", out / "logs"))
    task = (f"run_mindformer.py --config {out / 'mindformers.yaml'} --train_dataset_dir "
            f"{c.data.dataset or 'DATASET_DIR'} --use_parallel {run.devices > 1} --run_mode train")
    tail = (f" {run.devices}" if run.nodes == 1 else
            f" {run.devices} {run.workers} {addr} {port} NODE_RANK output/msrun_log False 300")
    mindformers = f'bash scripts/msrun_launcher.sh "{task}"{tail}' if run.devices > 1 else f"python {task}"
    pm = ["papermill", "notebooks/07_pretrain.ipynb", str(out / "07_pretrain.ipynb"), "-k", "python3"]
    for k, v in run.params.items():
        if v is not None and v != DEFAULTS[k] and k != "interactive":
            pm += ["-p", k, str(v)]
    resume = labkit[run.node_rank].replace(" --resume", "") + " --resume --steps N"
    # after mindformers' run: its shards (output/checkpoint, output/strategy under where it ran) as one checkpoint
    # and a Hugging Face model (labkit.byhand.ckpt_commands: MindSpore's transform_checkpoints, then ms2hf)
    merge = shlex.join(["labkit", "ckpt", "merge", mf_yaml.CHECKPOINTS, "--tool", "mindspore", "--strategy",
                        mf_yaml.STRATEGY, "--model", str(out / "run.yaml"), "--out", str(out / "merged"),
                        "--hf", str(out / "hf")])
    return {"labkit_launch": labkit, "msrun": msrun, "mindformers": mindformers, "papermill": shlex.join(pm),
            "resume": resume, "merge": merge}


NODE0_ONLY = {  # what a node other than node 0 skips in notebook 07, and why (printed by node0_only)
    "configs": "run.yaml, mindformers.yaml, plan.json and launch.sh are the run's files: node 0 writes them once "
               "into the shared output_dir (this node's own files are launch_node{r}.yaml and logs/node{r}/, "
               "written by labkit launch)",
    "checkpoint": "the checkpoints are the run's: rank 0 on node 0 saves them into the shared output_dir, and "
                  "node 0's notebook checks their shapes (here they may still be being written)",
    "summary": "the loss curve, metrics.jsonl and the checkpoints are rank 0's, on node 0: node 0's notebook "
               "checks them",
    "evaluation": "validation, generation and the HF copy read the run's checkpoint and write into the shared "
                  "output_dir: node 0's notebook does them, once for the run",
}


def node0_only(run: PretrainRun, what: str) -> bool:
    """True on node 0 (and with one node). On another node: print what it skips (NODE0_ONLY[what]) and why,
    and return False. With several nodes sharing output_dir, run-level files are written once, by node 0."""
    if run.node_rank == 0:
        return True
    print(f"node {run.node_rank} of {run.nodes} skips this cell: " + NODE0_ONLY[what].format(r=run.node_rank))
    return False


def config_texts(run: PretrainRun) -> dict[str, str]:
    """The texts of run.yaml, mindformers.yaml, plan.json and launch.sh (what write_configs writes)."""
    cmds = commands(run)
    given = {k: v for k, v in run.params.items() if v is not None and v != DEFAULTS[k]}
    start = (f"# Start it with: {cmds['labkit_launch'][0]}\n" if run.nodes == 1 else
             "# Start it with, on each node:\n" + "".join(f"#   {line}\n" for line in cmds["labkit_launch"]))
    return {
        "run.yaml": f"# labkit run config written by notebook 07 (preset {run.preset}, parameters {given}).\n"
                    + start + dump_run_config(run.cfg),
        "mindformers.yaml": mindformers_yaml(run),
        "plan.json": json.dumps({"preset": run.preset, "devices": run.devices, "nodes": run.nodes,
                                 "device": run.device.name, "device_memory_gib": run.device_memory_gib,
                                 "strategy": run.strategy.to_dict(),
                                 "alternatives": [r.to_dict() for r in run.alternatives[:10]],
                                 "can_train_here": run.can_train, "why_not": run.why_not}, indent=1, default=str),
        "launch.sh": "\n".join(
            ["#!/bin/sh", f"# Commands for this run ({run.devices} devices on {run.nodes} node(s)).", "",
             "# labkit (what notebook 07 runs), one line per node:"] + cmds["labkit_launch"] +
            ["", "# the command labkit launch runs on this node:", "# " + cmds["msrun"], "",
             "# the same run with mindformers' own launcher (from a mindformers checkout):", "# " + cmds["mindformers"],
             "", "# this notebook again, e.g. on a cluster:", "# " + cmds["papermill"], "",
             "# continue after an interruption:", "# " + cmds["resume"], "",
             "# after mindformers' run, from where it ran: its shards as one checkpoint and a Hugging Face model",
             "# (continue it on other cards instead: this notebook with -p resume_from output/checkpoint",
             "#  -p resume_strategy output/strategy):", "# " + cmds["merge"], ""]),
    }


def write_configs(run: PretrainRun) -> dict[str, Path]:
    """run.yaml, mindformers.yaml, plan.json and launch.sh in output_dir (each written atomically), by node 0:
    with several nodes sharing output_dir, these are the run's files, written once; another node writes none
    and returns {} (its own files are labkit launch's launch_node<R>.yaml and logs/node<R>/)."""
    if run.node_rank != 0:
        return {}
    return {name: atomic_write_text(run.output_dir / name, text) for name, text in config_texts(run).items()}
