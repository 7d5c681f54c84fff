"""The training state mindformers really creates, counted by building it: for a mindformers run YAML the lab writes
(labkit.parallel.mindformers_yaml.run_yaml), mindformers' own code sets the parallel context from the YAML's
`parallel` block (`core/context/parallel.py` ParallelOperator.init_communication), picks the wrapper its trainer
would pick (`trainer/base_trainer.py` BaseTrainer._reset_wrapper: MFPipelineWithLossScaleCell under semi-auto
parallel with gradient_accumulation_steps > 1, else the YAML's MFTrainOneStepCell), builds the network from
`model_config`, the optimizer from `optimizer` over its own parameter groups, and the wrapper with its loss-scale
cell. Every Parameter of the result is then classified by role and dtype:

    weights     the network's trainable parameters (by kind: matrix, norm, embedding, head)
    moments     the optimizer's first and second moments (`adam_m.*`, `adam_v.*`)
    accu_grads  the gradient accumulation buffer (`accu_grads.*`, MFPipelineWithLossScaleCell)
    scalars     step counters and the loss scale (a few bytes)

Each moment and buffer shadows one weight (its name after the prefix) and has that weight's shape: the census
states this as bytes per element of the weight shadowed, per role and kind, which is why it scales to 7B exactly
(a weight of the real model holds the same kind's bytes per element; only the element counts change).

It runs in msrun CPU workers (semi-auto parallel needs `init()`); the cells are built, never compiled (MindSpore
refuses to compile semi-auto parallel on CPU), so the shapes are full: the optimizer-parallel slicing happens at
compile time (labkit.parallel.memory models it from MindSpore's documentation).

    python -m labkit.launch.census --write       # msrun, 2 workers, ~1 min: rewrites STATE_FILE
The planner reads STATE_FILE; tests/test_census.py takes the census again and requires the same file."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

from labkit.config import AMP_LEVELS, RunConfig, load_run_config
from labkit.errors import LabkitError
from labkit.io import atomic_write_text
from labkit.parallel.mindformers_yaml import run_yaml
from labkit.runtime import prepare_process

STATE_FILE = Path(__file__).with_name("state_census.json")
RECIPE = "configs/llama2_7b_mindformers.yaml"  # the 7B run the census shrinks
WORKERS = 2
KINDS = ("matrix", "norm", "embedding", "head")
# the wrappers the trainer picks, by the micro-steps of the YAML (runner_config.gradient_accumulation_steps)
ACCUM = {"MFTrainOneStepCell": 1, "MFPipelineWithLossScaleCell": 2}
ROLE_OF_PREFIX = {"adam_m": "moments", "adam_v": "moments", "accu_grads": "accu_grads"}


def census_model():
    """Llama-2-7B's structure shrunk: the same flags and ratios, 2 layers, hidden 64, 4 heads, vocabulary 256."""
    cfg = load_run_config(RECIPE).model
    return dataclasses.replace(cfg, name="llama2_7b_census", hidden_size=64, num_layers=2, num_heads=4,
                               vocab_size=256, multiple_of=16, max_position_embeddings=64)


def census_run(amp_level: str, wrapper: str) -> RunConfig:
    """The 7B recipe's run config at `amp_level`, shrunk to census_model() on WORKERS devices, with the micro-steps
    that make the trainer pick `wrapper`."""
    if amp_level not in AMP_LEVELS or wrapper not in ACCUM:
        raise LabkitError(f"no census case for amp_level {amp_level!r} with {wrapper!r}",
                          f"use one of {', '.join(AMP_LEVELS)} and {', '.join(ACCUM)}")
    cfg = load_run_config(RECIPE, values={"train.amp_level": amp_level, "train.accum": ACCUM[wrapper],
                                          "train.micro_batch": 1, "train.global_batch": WORKERS * ACCUM[wrapper],
                                          "parallel.dp": WORKERS, "data.seq_len": 32})
    return dataclasses.replace(cfg, model=census_model())


def census_yaml(amp_level: str, wrapper: str) -> dict:
    """The mindformers run YAML of census_run (what notebook 07 writes, for the shrunk model)."""
    cfg = census_run(amp_level, wrapper)
    return run_yaml(cfg, cfg.layout(), devices=WORKERS, max_device_memory_gib=58.0)


def kind_of(name: str, shape: tuple) -> str:
    """A weight's kind by its mindformers name and shape."""
    if "embedding" in name:
        return "embedding"
    if "lm_head" in name:
        return "head"
    return "norm" if len(shape) == 1 else "matrix"


def classify(cell, network) -> dict:
    """Every Parameter of a built training cell: {name: {role, dtype, itemsize, shape, shadows, kind, and for a
    weight parallel_optimizer}}. The weights are the network's trainable parameters; a Parameter named
    `[optimizer.]<prefix>.<weight name>` shadows that weight, its role named by the prefix (ROLE_OF_PREFIX, or the
    prefix itself for one the census has not met: it still counts); anything else is a scalar."""
    weights = {p.name: p for p in network.trainable_params()}
    out = {}
    for _, p in cell.parameters_and_names():
        name, shape = p.name, tuple(int(d) for d in p.shape)
        row = {"dtype": str(p.dtype).lower(), "itemsize": int(p.itemsize), "shape": list(shape)}
        if name in weights:
            row.update(role="weights", shadows=name, kind=kind_of(name, shape),
                       parallel_optimizer=bool(p.parallel_optimizer))
        else:
            base = name[len("optimizer."):] if name.startswith("optimizer.") else name
            prefix, _, rest = base.partition(".")
            if rest in weights:
                w = weights[rest]
                if tuple(int(d) for d in w.shape) != shape:
                    raise LabkitError(f"census: {name} shadows {rest} but has shape {list(shape)}",
                                      "mindformers keeps this state in another shape: count it by hand")
                row.update(role=ROLE_OF_PREFIX.get(prefix, prefix), shadows=rest, kind=kind_of(rest, shape))
            else:
                row.update(role="scalars", shadows=None)
        out[name] = row
    return out


def summarize(params: dict) -> dict:
    """Per role and weight kind: the dtypes and the bytes per element of the weight shadowed (AdamW's m and v add
    up: 8 for two float32 moments); per kind whether its weights take part in optimizer sharding
    (`Parameter.parallel_optimizer`, True/False lists when the kind has both); the scalars' bytes."""
    shadowing = [r for r in params.values() if r["role"] != "scalars"]
    elements = {k: sum(math.prod(r["shape"]) for r in shadowing if r["role"] == "weights" and r["kind"] == k)
                for k in KINDS}
    roles: dict = {}
    for r in shadowing:
        cur = roles.setdefault(r["role"], {}).setdefault(r["kind"], {"dtypes": set(), "bytes": 0})
        cur["dtypes"].add(r["dtype"])
        cur["bytes"] += math.prod(r["shape"]) * r["itemsize"]
    return {"roles": {role: {kind: {"dtypes": sorted(c["dtypes"]), "bytes_per_element": c["bytes"] / elements[kind]}
                             for kind, c in sorted(kinds.items())} for role, kinds in sorted(roles.items())},
            "weight_elements": elements,
            "parallel_optimizer": {k: sorted({r["parallel_optimizer"] for r in shadowing
                                              if r["role"] == "weights" and r["kind"] == k})
                                   for k in KINDS if elements[k]},
            "scalar_bytes": sum(math.prod(r["shape"]) * r["itemsize"] for r in params.values()
                                if r["role"] == "scalars")}


# ------------------------------------------------------------------------------------------- the msrun worker


def build_cell(path: Path):
    """mindformers' training cell for the run YAML at `path`, as its trainer builds it (see the module docstring);
    returns (cell, network, the wrapper's type)."""
    import mindspore as ms
    from mindformers import MindFormerConfig
    from mindformers.core.context.parallel import ParallelOperator
    from mindformers.core.lr import build_lr
    from mindformers.core.optim import build_optim
    from mindformers.core.parallel_config import build_parallel_config
    from mindformers.models import build_network
    from mindformers.tools.utils import PARALLEL_MODE
    from mindformers.trainer.base_trainer import BaseTrainer
    from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters
    from mindformers.wrapper import build_wrapper

    cfg = MindFormerConfig(str(path))
    cfg.parallel.parallel_mode = PARALLEL_MODE[cfg.parallel.parallel_mode]
    ParallelOperator(cfg).init_communication()  # the YAML's parallel block, as mindformers sets it
    build_parallel_config(cfg)
    trainer = BaseTrainer.__new__(BaseTrainer)  # its config checks and wrapper choice, without a dataset
    trainer.config = cfg
    trainer._check_global_batch_size_for_auto_parallel()
    trainer._reset_wrapper()
    net = build_network(cfg.model, default_args={"parallel_config": cfg.parallel_config})
    lr = build_lr(cfg.lr_schedule)
    groups = get_optimizer_grouped_parameters(model=net, weight_decay=cfg.optimizer.weight_decay,
                                              dynamic_lr_schedule=lr, optimizer_type=cfg.optimizer.type)
    opt = build_optim(cfg.optimizer, default_args={"params": groups, "learning_rate": lr})
    cell = build_wrapper(cfg.runner_wrapper, default_args={"network": net, "optimizer": opt,
                                                           "parallel_config": cfg.parallel_config})
    ms.reset_auto_parallel_context()
    return cell, net, cfg.runner_wrapper.type


def worker(out: Path) -> int:
    """In an msrun worker: every YAML under out/yaml/, its census into out/<name>.json (rank 0 writes)."""
    import mindspore as ms
    from mindspore.communication import get_rank

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    for path in sorted((out / "yaml").glob("*.yaml")):
        cell, net, wrapper = build_cell(path)
        params = classify(cell, net)
        if get_rank() == 0:
            atomic_write_text(out / f"{path.stem}.json",
                              json.dumps({"wrapper": wrapper, "params": params, **summarize(params)}, indent=1))
    return 0


def versions() -> dict:
    from importlib.metadata import version

    return {"mindspore": version("mindspore"), "mindformers": version("mindformers")}


@functools.cache
def load_states() -> dict:
    """STATE_FILE: the census the planner counts with, read once per process (the planner asks for it for every
    candidate strategy; the file changes only by `python -m labkit.launch.census --write`). Read, never modify."""
    if not STATE_FILE.exists():
        raise LabkitError(f"{STATE_FILE} is missing", "take it with: python -m labkit.launch.census --write")
    return json.loads(STATE_FILE.read_text())


def main(argv=None) -> int:
    """`python -m labkit.parallel.census worker OUT` in each msrun worker (labkit.launch.census starts them)."""
    ap = argparse.ArgumentParser(prog="python -m labkit.parallel.census")
    ap.add_argument("what", choices=("worker",))
    ap.add_argument("out")
    args = ap.parse_args(argv)
    prepare_process("CPU")
    return worker(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
