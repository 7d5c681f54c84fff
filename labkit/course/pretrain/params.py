"""Notebook 07's parameters: one typed, commented entry per parameter (the config fields' own names), the presets,
the device preset per target and the planner's precision per AMP level."""
from __future__ import annotations

from dataclasses import dataclass

from labkit.config import AMP_LEVELS


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # as written in the notebook's parameters cell
    default: object
    field: str | None  # the RunConfig field it sets (dotted); None = a notebook-only parameter
    help: str


PARAMETERS = (
    Param("preset", "str", "tiny", None, "tiny (CPU smoke run), tiny_10min (~10 min on 2 cores, writes text), llama2_7b "
          "(mindformers' 7B recipe, 8 x 64 GiB) or llama2_7b_seed (the seeds' 7B recipe, made to fit)"),
    Param("config", "Optional[str]", None, None, "run config YAML to start from; None: the preset's"),
    Param("device_target", "Optional[str]", None, "parallel.device_target", "CPU, GPU or Ascend; None: the config's"),
    Param("devices", "Optional[int]", None, None, "devices (worker processes) over all nodes; None: the preset's"),
    Param("nodes", "Optional[int]", None, None, "servers; None: 1 on CPU, else devices / cards per server"),
    Param("node_rank", "int", 0, None, "this server's number, 0..nodes-1 (run the notebook on every node)"),
    Param("master_addr", "Optional[str]", None, None, "host of node 0 (needed with nodes > 1)"),
    Param("master_port", "Optional[int]", None, None, "scheduler port; None: a free one (set it with nodes > 1)"),
    Param("device", "Optional[str]", None, None, "planner device preset (atlas_800t_a2, a100_80g, h100_80g, "
          "h200_141g, cpu); None: from device_target"),
    Param("device_memory_gib", "Optional[float]", None, None, "memory per device in GiB; None: the device "
          "preset's (CPU: host RAM / workers)"),
    Param("dp", "Optional[int]", None, "parallel.dp", "data-parallel size; None: the planner's best"),
    Param("mp", "Optional[int]", None, "parallel.mp", "tensor-parallel size; None: the planner's best (1 on CPU)"),
    Param("pp", "Optional[int]", None, "parallel.pp", "pipeline stages; None: the planner's best (1 on CPU)"),
    Param("optimizer_shard", "Optional[bool]", None, "parallel.optimizer_shard",
          "shard optimizer states over dp (Ascend/GPU); None: the config's"),
    Param("micro_batch", "Optional[int]", None, "train.micro_batch",
          "samples per device per micro-step; None: the config's, lowered to divide global_batch / dp"),
    Param("accum", "Optional[int]", None, "train.accum", "micro-steps per optimizer step; None: global_batch / "
          "(micro_batch x dp)"),
    Param("global_batch", "Optional[int]", None, "train.global_batch", "samples per optimizer step; None: the "
          "config's"),
    Param("seq_len", "Optional[int]", None, "data.seq_len", "tokens per sample; None: the config's"),
    Param("recompute", "Optional[str]", None, "train.recompute", "none, all, last:K, first:K or A-B (layers); "
          "None: the config's"),
    Param("amp_level", "Optional[str]", None, "train.amp_level", "O0 (fp32), O2 (fp16 compute, fp32 weights) or "
          "O3; None: the config's"),
    Param("lr", "Optional[float]", None, "train.lr", "peak learning rate; None: the config's"),
    Param("warmup_steps", "Optional[int]", None, "train.warmup_steps", "linear warmup steps; None: the config's"),
    Param("min_lr", "Optional[float]", None, "train.min_lr", "end of the cosine decay; None: the config's"),
    Param("steps", "Optional[int]", None, "train.steps", "optimizer steps to train to; None: the preset's (tiny: "
          "30, a smoke run)"),
    Param("save_every", "Optional[int]", None, "train.save_every", "checkpoint every N steps (0: only at the end); "
          "None: the config's"),
    Param("dataset", "Optional[str]", None, "data.dataset", "MindRecord folder (`labkit data build`); None: the "
          "config's (null: build the shipped corpus)"),
    Param("tokenizer", "Optional[str]", None, "data.tokenizer", "tokenizer folder; None: the config's"),
    Param("init_checkpoint", "Optional[str]", None, "train.init_checkpoint",
          "converted HF weights to start from (`labkit convert hf2ms` output); None: random init"),
    Param("output_dir", "Optional[str]", None, "output_dir", "run folder, relative to where you run; None: "
          "runs/pretrain/<preset> (replaced on every run)"),
    Param("resume", "bool", False, None, "continue from the newest checkpoint in output_dir"),
    Param("overwrite", "bool", False, None, "start over in an output_dir that already holds a run"),
    Param("interactive", "bool", False, None, "show the widget form (JupyterLab; ignored under papermill/nbval)"),
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


# how the planner counts each mixed-precision level (labkit.config.AMP_LEVELS, the one table of them):
# (compute precision, fp32 master weights kept beside lower-precision compute)
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
AMP_PRECISION = {level: (_SHORT[d["compute_dtype"]],
                         d["param_dtype"] == "float32" and d["compute_dtype"] != "float32")
                 for level, d in AMP_LEVELS.items()}


# what the seeds' reference configuration says, before the change configs/llama2_7b_seed.yaml ships
SEED_AS_WRITTEN = {"parallel.optimizer_shard": False, "parallel.parallel_mode": "data_parallel",
                   "train.micro_batch": 4, "train.accum": 16, "train.recompute": "last:16"}
