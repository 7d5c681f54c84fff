"""The parallel part of a mindformers run YAML (parallel, parallel_config, recompute_config) for a layout the
planner chose, with the key names mindformers 1.9.0 reads: built as a mapping, written with yaml.safe_dump."""
from __future__ import annotations

import yaml

from labkit.layout import Layout
from labkit.errors import LabkitError


PARALLEL_MODES = {"data_parallel": 0, "semi_auto_parallel": 1, "auto_parallel": 2}
SEARCH_MODES = ("sharding_propagation", "recursive_programming")


def mindformers_parallel_config(layout: Layout, *, parallel_mode: str = "semi_auto_parallel",
                                search_mode: str = "sharding_propagation", num_layers: int | None = None) -> dict:
    """The `parallel`, `parallel_config`, `recompute_config` and `runner_config` blocks of a mindformers run YAML
    for a layout (keys as in mindformers r1.5.0 configs/llama2/pretrain_llama2_7b.yaml). `num_layers` is needed
    only when the layout recomputes some layers (`last:K`...): mindformers counts them per pipeline stage."""
    if parallel_mode not in PARALLEL_MODES:
        raise LabkitError(f"parallel_mode '{parallel_mode}' is not known", f"use {', '.join(PARALLEL_MODES)}")
    if search_mode not in SEARCH_MODES:
        raise LabkitError(f"search_mode '{search_mode}' is not known", f"use {' or '.join(SEARCH_MODES)}")
    s = layout.row()
    pipeline = s["pp"] > 1
    rc = layout.recompute.mindformers(num_layers, s["pp"])
    return {
        "use_parallel": True,
        "parallel": {"parallel_mode": PARALLEL_MODES[parallel_mode], "gradients_mean": False,
                     "enable_alltoall": False, "full_batch": True, "search_mode": search_mode,
                     "enable_parallel_optimizer": bool(s["optimizer_shard"]),
                     "strategy_ckpt_save_file": "./ckpt_strategy.ckpt",
                     "parallel_optimizer_config": {"gradient_accumulation_shard": False,
                                                   "parallel_optimizer_threshold": 64}},
        "parallel_config": {"data_parallel": s["dp"], "model_parallel": s["mp"], "pipeline_stage": s["pp"],
                            "use_seq_parallel": bool(layout.sequence_parallel),
                            "micro_batch_num": s["accum"] if pipeline else 1,
                            "vocab_emb_dp": True, "gradient_aggregation_group": 4},
        "micro_batch_interleave_num": 1,
        "recompute_config": {**rc, "parallel_optimizer_comm_recompute": False, "mp_comm_recompute": True,
                             "recompute_slice_activation": True},
        "runner_config": {"batch_size": s["micro_batch"], "gradient_accumulation_steps": 1 if pipeline else s["accum"]},
    }


def mindformers_parallel_yaml(layout: Layout, **options) -> str:
    """mindformers_parallel_config() as YAML text, under a comment naming the plan and the less obvious keys."""
    doc = mindformers_parallel_config(layout, **options)
    s = layout.row()
    head = (f"# planned: dp={s['dp']} mp={s['mp']} pp={s['pp']}, micro_batch {s['micro_batch']} x {s['accum']} "
            f"micro-steps, recompute {s['recompute']}, optimizer_shard {s['optimizer_shard']}\n"
            "# parallel_mode: 0 data, 1 semi-auto, 2 auto parallel; search_mode: used by auto_parallel only;\n"
            "# enable_parallel_optimizer: shard optimizer states (and weights) over dp; micro_batch_num: pipeline\n"
            "# micro-batches per step (>= pipeline_stage); runner_config.batch_size: per device and micro-step\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


# mindformers computes the global batch in its trainer (BaseTrainer._check_global_batch_size_for_auto_parallel),
# from the context MindSpore has and the YAML it reads. Running that very method on a YAML this module wrote is an
# independent reading of it. It sets MindSpore's auto-parallel context, so it runs in a child process; the method is
# private to mindformers 1.9 (pinned), which is why it is called in one place only.
_GLOBAL_BATCH_CHILD = """
import sys, types
from labkit.logs import quiet_mindformers
quiet_mindformers()  # mindformers' import without torch, HF datasets and nltk: 3 s of the child instead of 7.7
import mindspore as ms
from mindformers import MindFormerConfig
from mindformers.tools.utils import PARALLEL_MODE
from mindformers.trainer.base_trainer import BaseTrainer

cfg = MindFormerConfig(sys.argv[1])
pp = cfg.parallel_config.pipeline_stage or 1
mode = PARALLEL_MODE[cfg.parallel.parallel_mode]  # mindformers' own reading of the YAML's integer
ms.set_auto_parallel_context(parallel_mode=mode, full_batch=bool(cfg.parallel.full_batch), pipeline_stages=pp)
cfg.micro_batch_interleave_num = cfg.micro_batch_interleave_num or 1
trainer = types.SimpleNamespace(config=cfg, get_pipeline_stages=lambda: pp, _reset_wrapper_for_pipeline_parallel=lambda: None)
BaseTrainer._check_global_batch_size_for_auto_parallel(trainer)
print("labkit global_batch:", trainer.global_batch_size)
"""


def mindformers_global_batch(yaml_path, timeout: float = 300) -> int:
    """The global batch mindformers' own trainer derives from the parallel YAML at `yaml_path` (data_parallel x
    batch_size x micro-steps, as its BaseTrainer computes it), read in a child process."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _GLOBAL_BATCH_CHILD, str(yaml_path)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "GLOG_v": "3"})
    line = next((x for x in p.stdout.splitlines() if x.startswith("labkit global_batch:")), None)
    if p.returncode or line is None:
        raise LabkitError(f"mindformers could not read the global batch of {yaml_path} (exit {p.returncode}): "
                          f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'no output'}",
                          "check the YAML's parallel, parallel_config and runner_config sections")
    return int(line.split(":")[1])
