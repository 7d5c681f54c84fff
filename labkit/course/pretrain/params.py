"""Notebook 07's parameters: one typed, commented entry per parameter (the config fields' own names), the presets,
the device preset per target and the planner's precision per AMP level."""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass

from labkit.config import RunConfig
from labkit.layout import Recompute


def field_type(dotted: str):
    """The type hint of a RunConfig field, e.g. field_type("train.lr") is float."""
    tp = RunConfig
    for part in dotted.split("."):
        tp = typing.get_type_hints(tp)[part]
    return tp


def scalar_of(tp) -> type:
    """What a parameter for a config field of type `tp` is given as: int, float, str or bool (a Literal's values'
    type, a Recompute's text; `X | None` gives X's)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return scalar_of(next(a for a in typing.get_args(tp) if a is not type(None)))
    return str if tp is Recompute else tp


@dataclass(frozen=True)
class Param:
    name: str
    given: type | None  # a notebook-only parameter's type (int, float, str, bool); None: its config field's
    default: object
    field: str | None  # the RunConfig field it sets (dotted); None = a notebook-only parameter
    help: str

    @property
    def scalar(self) -> type:
        return self.given or scalar_of(field_type(self.field))

    @property
    def type(self):
        """The type a value is checked against: None is allowed where the default is None (the config's value)."""
        return self.scalar | None if self.default is None else self.scalar

    @property
    def type_name(self) -> str:
        """The type as the notebook's parameters cell writes it."""
        return f"Optional[{self.scalar.__name__}]" if self.default is None else self.scalar.__name__


PARAMETERS = (
    Param("preset", str, "tiny", None, "tiny (CPU smoke run), tiny_10min (~10 min on 2 cores, writes text), llama2_7b "
          "(mindformers' 7B recipe, 8 x 64 GiB) or llama2_7b_seed (the seeds' 7B recipe, made to fit)"),
    Param("config", str, None, None, "run config YAML to start from; None: the preset's"),
    Param("device_target", None, None, "parallel.device_target", "CPU, GPU or Ascend; None: the config's"),
    Param("devices", int, None, None, "devices (worker processes) over all nodes; None: the preset's"),
    Param("nodes", int, None, None, "servers; None: 1 on CPU, else devices / cards per server"),
    Param("node_rank", int, 0, None, "this server's number, 0..nodes-1 (run the notebook on every node)"),
    Param("master_addr", str, None, None, "host of node 0 (needed with nodes > 1)"),
    Param("master_port", int, None, None, "scheduler port; None: a free one (set it with nodes > 1)"),
    Param("device", str, None, None, "planner device preset (atlas_800t_a2, a100_80g, h100_80g, "
          "h200_141g, cpu); None: from device_target"),
    Param("device_memory_gib", float, None, None, "memory per device in GiB; None: the device "
          "preset's (CPU: host RAM / workers)"),
    Param("dp", None, None, "parallel.dp", "data-parallel size; None: the planner's best"),
    Param("mp", None, None, "parallel.mp", "tensor-parallel size; None: the planner's best (1 on CPU)"),
    Param("pp", None, None, "parallel.pp", "pipeline stages; None: the planner's best (1 on CPU)"),
    Param("optimizer_shard", None, None, "parallel.optimizer_shard",
          "MindSpore's parallel optimizer: weights and optimizer states sharded over dp (Ascend/GPU); None: the "
          "config's"),
    Param("optimizer_level", None, None, "parallel.optimizer_level",
          "level1 (weights, moments), level2 (+ gradients and the accumulation buffer) or level3 (+ weights "
          "gathered again for the backward); None: the config's"),
    Param("micro_batch", None, None, "train.micro_batch",
          "samples per device per micro-step; None: the config's, lowered to divide global_batch / dp"),
    Param("accum", None, None, "train.accum", "micro-steps per optimizer step; None: global_batch / "
          "(micro_batch x dp)"),
    Param("global_batch", None, None, "train.global_batch", "samples per optimizer step; None: the "
          "config's"),
    Param("seq_len", None, None, "data.seq_len", "tokens per sample; None: the config's"),
    Param("recompute", None, None, "train.recompute", "none, all, last:K, first:K or A-B (layers); "
          "None: the config's"),
    Param("amp_level", None, None, "train.amp_level", "O0 (fp32), O2 (fp16 compute, fp32 weights), O3, fp16 "
          "or bf16 (mindformers' 7B recipes: fp16 weights, fp16/bf16 compute); None: the config's"),
    Param("lr", None, None, "train.lr", "peak learning rate; None: the config's"),
    Param("warmup_steps", None, None, "train.warmup_steps", "linear warmup steps; None: the config's"),
    Param("min_lr", None, None, "train.min_lr", "end of the cosine decay; None: the config's"),
    Param("steps", None, None, "train.steps", "optimizer steps to train to; None: the preset's (tiny: "
          "30, a smoke run)"),
    Param("save_every", None, None, "train.save_every", "checkpoint every N steps (0: only at the end); "
          "None: the config's"),
    Param("dataset", None, None, "data.dataset", "MindRecord folder (`labkit data build`); None: the "
          "config's (null: build the shipped corpus)"),
    Param("tokenizer", None, None, "data.tokenizer", "tokenizer folder; None: the config's"),
    Param("init_checkpoint", None, None, "train.init_checkpoint",
          "converted HF weights to start from (`labkit convert hf2ms` output); None: random init"),
    Param("output_dir", None, None, "output_dir", "run folder, relative to where you run; None: "
          "runs/pretrain/<preset> (replaced on every run)"),
    Param("resume", bool, False, None, "continue from the newest checkpoint in output_dir"),
    Param("resume_from", str, None, None, "mindformers launcher: an earlier run's checkpoint folder (its "
          "output/checkpoint, one rank_N folder per card) to continue from; None: none"),
    Param("resume_strategy", str, None, None, "mindformers launcher: that run's strategy folder (its "
          "output/strategy) when it ran on another number of cards or layout: mindformers reshards (auto_trans_ckpt)"),
    Param("overwrite", bool, False, None, "start over in an output_dir that already holds a run"),
    Param("interactive", bool, False, None, "show the widget form (JupyterLab; ignored under papermill/nbval)"),
)


PARAMS = {p.name: p for p in PARAMETERS}


DEFAULTS = {p.name: p.default for p in PARAMETERS}


# preset -> the run config it starts from, what it changes there, the devices it brings, the planner's device
PRESETS = {
    "tiny": dict(config="configs/tiny_cpu.yaml", devices=1, overrides={"train.steps": 30, "train.save_every": 10}),
    "tiny_10min": dict(config="configs/tiny_10min.yaml", devices=1),
    "llama2_7b": dict(config="configs/llama2_7b_mindformers.yaml", devices=8, device="atlas_800t_a2"),
    "llama2_7b_seed": dict(config="configs/llama2_7b_seed.yaml", devices=8, device="atlas_800t_a2"),
}


DEVICE_FOR_TARGET = {"CPU": "cpu", "Ascend": "atlas_800t_a2", "GPU": "a100_80g"}


# what the seeds' reference configuration says, before the change configs/llama2_7b_seed.yaml ships
SEED_AS_WRITTEN = {"parallel.optimizer_shard": False, "parallel.parallel_mode": "data_parallel",
                   "train.micro_batch": 4, "train.accum": 16, "train.recompute": "last:16"}
