"""Typed configs. Every knob is one dataclass field with a type, a default and a comment giving its unit;
YAML, the CLI (`--set a.b=c`), papermill parameters and widgets all use these names.

`load(cls, data, where)` turns a mapping into a dataclass, refusing unknown keys and wrong types with a
message that names the field, the file and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from labkit.errors import LabkitError
from labkit.layout import Layout, OptimizerParallel, Recompute
from labkit.io import read_yaml_file
from labkit.paths import lab_path

# --------------------------------------------------------------------------------------------- loading


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp, where: str):
    """Check (and gently convert) one value against a type annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise LabkitError(f"{where} = {value!r} is not allowed", f"use one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LabkitError(f"{where} must be a list, got {value!r}", "write it as [a, b, ...]")
        (arg, *_) = typing.get_args(tp) or (Any,)
        return [coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise LabkitError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if tp is Recompute:
        return Recompute.parse(value, where)
    if tp is ModelConfig and isinstance(value, dict) and "preset" in value:
        return model_from_section(value, where)
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else load(tp, value, where)
    if tp is Any:
        return value
    scalar = _SCALARS.get(tp) if isinstance(tp, type) else None
    if scalar is None:
        raise LabkitError(f"{where}: unsupported type {_type_name(tp)}")
    return scalar(value, where)


def _coerce_union(value: Any, args: tuple, where: str):
    """The first member of `X | Y | None` that takes the value; else the first member's error."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, where)
        except LabkitError as e:
            errors.append(e)
    raise errors[0]


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    raise LabkitError(f"{where} must be true or false, got {value!r}")


def _to_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise LabkitError(f"{where} must be an integer, got {value!r}")
    try:
        f = float(value)
    except ValueError:
        raise LabkitError(f"{where} must be an integer, got {value!r}") from None
    if not math.isfinite(f) or f != int(f):
        raise LabkitError(f"{where} must be an integer, got {value!r}")
    return int(f)


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise LabkitError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise LabkitError(f"{where} must be a number, got {value!r}") from None


def _to_str(value: Any, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise LabkitError(f"{where} must be a string, got {value!r}")
    return str(value)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def load(cls, data: dict | None, where: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise LabkitError."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise LabkitError(f"{where or cls.__name__} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
            raise LabkitError(f"unknown key '{name}'", fix)
        kwargs[key] = coerce(value, hints[key], name)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check:
        check(where)
    return obj


def to_dict(obj) -> dict:
    """A config as plain data, as YAML writes it (a Recompute as its text; a run's model as `preset: NAME` plus the
    fields that differ from the preset, when its name is a preset's)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}


def _plain(value):
    if isinstance(value, Recompute):
        return str(value)
    if isinstance(value, ModelConfig) and value.name in MODEL_PRESETS:
        mine, preset = to_dict(value), to_dict(model_preset(value.name))
        return {"preset": value.name, **{k: v for k, v in mine.items() if v != preset[k]}}
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def read_yaml(path: str | Path) -> dict:
    path = lab_path(path)
    if not path.is_file():
        raise LabkitError(f"config file {path} not found", "check the path (configs/ resolves from the lab root)")
    data = read_yaml_file(path)  # not UTF-8, tabs, syntax: one line naming file, line and column
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LabkitError(f"{path} must hold a mapping at the top level")
    return data


def set_dotted(data: dict, assignment: str) -> dict:
    """Apply `a.b=c` (value parsed as YAML) to a nested mapping, in place."""
    if "=" not in assignment:
        raise LabkitError(f"--set {assignment!r} has no '='", "write --set key=value, e.g. --set train.lr=3e-4")
    key, raw = assignment.split("=", 1)
    return set_value(data, key.strip(), yaml.safe_load(raw) if raw != "" else None)


def set_value(data: dict, key: str, value) -> dict:
    """Set dotted `key` (`a.b`) of a nested mapping to `value` as it is (typed, not parsed), in place."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise LabkitError(f"--set {key}: '{part}' is not a section")
    node[parts[-1]] = value
    return data


# the command-line flags of `labkit train` and `labkit launch` that set a config field, and that field
RUN_FLAGS = {"steps": "train.steps", "micro_batch": "train.micro_batch", "accum": "train.accum",
             "seed": "train.seed", "output": "output_dir"}


def flag_values(source) -> dict:
    """RUN_FLAGS' fields with the values `source` (argparse namespace, LaunchSpec) gives them; None ones left out."""
    values = {key: getattr(source, flag, None) for flag, key in RUN_FLAGS.items()}
    return {k: str(v) if k == "output_dir" else v for k, v in values.items() if v is not None}


def _positive(obj, where: str, *names: str):
    for n in names:
        v = getattr(obj, n)
        if v is not None and v <= 0:
            raise LabkitError(f"{where + '.' if where else ''}{n} must be > 0, got {v}")


# ---------------------------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """A Llama-family decoder. Names follow HF `LlamaConfig` where one exists."""

    name: str = "tiny"  # preset name or a free label
    vocab_size: int = 4096  # tokens in the vocabulary (embedding rows)
    hidden_size: int = 256  # model width d_model
    num_layers: int = 4  # decoder layers
    num_heads: int = 8  # attention (query) heads
    num_kv_heads: int | None = None  # key/value heads for grouped-query attention; None = num_heads
    intermediate_size: int | None = None  # SwiGLU FFN width; None = Llama rule from multiple_of
    multiple_of: int = 256  # the Llama rule rounds the FFN width up to a multiple of this
    ffn_dim_multiplier: float | None = None  # optional factor in the Llama FFN rule
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    max_position_embeddings: int = 2048  # longest sequence the model is meant for (tokens)
    tie_word_embeddings: bool = False  # share the input embedding with the output layer
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    init_std: float = 0.02  # std of the normal init; output projections are scaled by 1/sqrt(2*num_layers)
    scale_residual_init: bool = True  # that 1/sqrt(2*num_layers) on attention.wo and feed_forward.w2; false: init_std

    def validate(self, where: str = ""):
        _positive(self, where, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "multiple_of", "rms_norm_eps", "rope_theta", "max_position_embeddings")
        if self.hidden_size % self.num_heads:
            raise LabkitError(f"{where}.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
                              "choose num_heads dividing hidden_size")
        if self.num_heads % self.kv_heads:
            raise LabkitError(f"{where}.num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """SwiGLU width: given, or Llama's rule (2/3 of 4h, times the multiplier, rounded up to multiple_of)."""
        if self.intermediate_size:
            return self.intermediate_size
        h = int(2 * 4 * self.hidden_size / 3)
        if self.ffn_dim_multiplier:
            h = int(self.ffn_dim_multiplier * h)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


MODEL_PRESETS: dict[str, dict] = {
    # learns visibly in a minute on 2 CPU cores; vocab matches the shipped tokenizer. Two decoder layers: every
    # lesson here works at that depth, and the course's runs (each compiles a graph that grows with depth) take
    # ~38% less CPU time than with four (notebook 04 back to back on 2 cores: 144 against 231 CPU-s)
    "tiny": dict(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                 max_position_embeddings=512),
    # ~30M parameters: a model where the matrix work, not the element-wise work, starts to dominate a CPU step
    "small": dict(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                  max_position_embeddings=512),
    # ~110M parameters, GPT-2-small-like width; too slow to train on CPU beyond a few steps
    "llama_100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
                       tie_word_embeddings=True, max_position_embeddings=2048),
    # Llama-2-7B as published (6,738,415,616 parameters)
    "llama2_7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, multiple_of=256,
                      max_position_embeddings=4096, rms_norm_eps=1e-5),
}


def model_from_section(section: dict, where: str = "model") -> ModelConfig:
    """A run config's `model:` section: `preset: NAME` plus ModelConfig overrides, or the ModelConfig fields."""
    spec = dict(section)
    preset = spec.pop("preset", None)
    if preset:
        return model_preset(str(preset), **spec)
    return load(ModelConfig, spec, where)


def model_preset(name: str, **overrides) -> ModelConfig:
    if name not in MODEL_PRESETS:
        close = difflib.get_close_matches(name, list(MODEL_PRESETS), n=1)
        raise LabkitError(f"unknown model preset '{name}'",
                          f"did you mean '{close[0]}'?" if close else f"presets: {', '.join(MODEL_PRESETS)}")
    return load(ModelConfig, {"name": name, **MODEL_PRESETS[name], **overrides}, "model")


# ------------------------------------------------------------------------------------------ training run


@dataclass
class DataConfig:
    """Where training data comes from. With `dataset: null` the run builds a MindRecord set from the shipped corpus
    and tokenizer on first use (cached under runs/cache)."""

    dataset: str | None = None  # MindRecord directory from `labkit data build`; null = build from corpus on first use
    corpus: list[str] | None = None  # text files/dirs for the first-use build; null = data/corpus
    tokenizer: str = "data/tokenizer"  # tokenizer directory (HF format with tokenizer.model)
    seq_len: int = 128  # tokens per sample fed to the model (samples hold seq_len + 1 for the shifted labels)
    shuffle: bool = True  # seeded global shuffle per epoch
    num_parallel_workers: int = 1  # MindDataset worker threads
    prefetch: int = 16  # MindDataset prefetch (rows per worker)
    val_fraction: float = 0.0  # share of whole documents held out for validation (first-use build); 0 = none
    val_seed: int = 0  # seed of the document split into training and validation

    def validate(self, where: str = "data"):
        _positive(self, where, "seq_len", "num_parallel_workers", "prefetch")
        if not 0 <= self.val_fraction < 1:
            raise LabkitError(f"{where}.val_fraction {self.val_fraction} must be in [0, 1)", "use e.g. 0.02")


@dataclass
class TrainConfig:
    """The optimisation loop. Step = one optimizer update (micro_batch x dp x accum samples)."""

    steps: int = 60  # stop after this optimizer step, counted from the start of training (resume continues to it)
    micro_batch: int = 8  # samples per worker per forward/backward
    accum: int = 1  # gradient-accumulation micro-steps per optimizer step
    global_batch: int | None = None  # optional check: must equal micro_batch * dp * accum
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 10  # linear warmup from 0 to lr (optimizer steps)
    decay_steps: int = 200  # schedule horizon: cosine reaches min_lr here, independent of `steps`
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay on matrices (not on norm gains)
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)
    amp_level: Literal["O0", "O1", "O2", "O3", "fp16", "bf16"] = "O0"  # mixed precision (labkit.config.AMP_LEVELS)
    loss_scale: float = 65536.0  # initial dynamic loss scale (used with O1-O3)
    scale_window: int = 1000  # steps without overflow before the loss scale grows by scale_factor
    scale_factor: int = 2  # loss-scale growth/shrink factor
    recompute: Recompute = Recompute()  # activation recomputation: none | all | last:K | first:K | A-B (layer range)
    seed: int = 1234  # model init, data order
    grad_norm_alert: float = 10.0  # warn when the global gradient norm exceeds this
    save_every: int = 0  # write a full training checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest K checkpoints
    init_checkpoint: str | None = None  # weights to start from (a `labkit convert hf2ms` output dir or a checkpoint)
    peak_tflops: float | None = None  # device peak for MFU (TFLOP/s); null = measure a GEMM probe at start
    mode: Literal["graph", "pynative"] = "graph"  # MindSpore execution mode
    kernels: Literal["native", "custom"] = "native"  # CPU norm/SwiGLU/RoPE/attention/loss/AdamW: MindSpore's or C++
    eval_every: int = 0  # mean loss over the validation set every N steps and at the end (0 = off)
    eval_samples: int = 0  # validation samples each evaluation reads, spread evenly over the set (0 = all of them)
    sample_prompts: list[str] = field(default_factory=list)  # texts continued at each evaluation (samples.jsonl)
    sample_tokens: int = 48  # new tokens per sample
    sample_temperature: float = 0.8  # sampling temperature of the logged samples (0 = greedy)
    sample_top_k: int = 40  # sample among the k most likely tokens (0 = all)

    def validate(self, where: str = "train"):
        _positive(self, where, "steps", "micro_batch", "accum", "global_batch", "lr", "decay_steps",
                  "loss_scale", "scale_window", "keep_checkpoints", "peak_tflops")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise LabkitError(f"{where}.min_lr {self.min_lr} must be between 0 and lr {self.lr}")
        if self.warmup_steps < 0 or self.warmup_steps > self.decay_steps:
            raise LabkitError(f"{where}.warmup_steps {self.warmup_steps} must be between 0 and decay_steps "
                              f"{self.decay_steps}")
        if self.save_every < 0 or self.grad_clip < 0 or self.eval_every < 0 or self.eval_samples < 0:
            raise LabkitError(f"{where}.save_every, grad_clip, eval_every and eval_samples must be >= 0")
        if self.sample_tokens < 1 or self.sample_temperature < 0 or self.sample_top_k < 0:
            raise LabkitError(f"{where}.sample_tokens must be >= 1, sample_temperature and sample_top_k >= 0")


@dataclass
class ParallelConfig:
    """How the run is spread over devices (MindSpore's parallel mode names)."""

    parallel_mode: Literal["stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel"] | None = None
    # null = stand_alone for one worker, data_parallel for more
    dp: int | None = None  # data-parallel size; null = all workers (data_parallel) or the planner's choice
    mp: int = 1  # tensor (model) parallel size (semi_auto/auto only)
    pp: int = 1  # pipeline stages (semi_auto/auto only)
    cp: int = 1  # context parallel: devices each sequence is split over (semi_auto/auto, flash attention only)
    cp_algo: Literal["colossalai_cp", "ulysses_cp", "hybrid_cp"] = "colossalai_cp"  # mindformers'
    # context_parallel_algo: key/value blocks round a ring, Ulysses' all-to-all head split, or both
    ulysses_degree: int = 1  # hybrid_cp: the Ulysses part of cp (ulysses_degree_in_cp), dividing cp
    optimizer_shard: bool = False  # MindSpore's parallel optimizer (enable_parallel_optimizer; semi_auto/auto):
    # weights and optimizer states sharded over dp, gathered before use (labkit.layout.OptimizerParallel)
    optimizer_level: Literal["level1", "level2", "level3"] = "level1"  # parallel_optimizer_config.optimizer_level:
    # level2 also shards the gradients and the accumulation buffer, level3 gathers the weights again for backward
    gradient_accumulation_shard: bool = False  # shard the accumulation buffer over dp (what level2 replaces)
    optimizer_threshold_kb: int = 64  # parallel_optimizer_threshold: parameters under this size (KB) stay whole
    optimizer_weight_shard_size: int = -1  # optimizer_weight_shard_size: -1 = the parameter's whole dp group
    optimizer_comm_recompute: bool = False  # recompute_config.parallel_optimizer_comm_recompute: recomputed
    # layers gather their weights again in the backward pass
    search_mode: Literal["sharding_propagation", "recursive_programming"] = "sharding_propagation"  # auto_parallel
    device_target: Literal["CPU", "GPU", "Ascend"] = "CPU"  # MindSpore device target
    cluster_timeout_s: int = 120  # seconds every process waits for all workers of all nodes to join (msrun
    # --cluster_time_out); then the job ends and the report names the node that never joined

    def validate(self, where: str = "parallel"):
        _positive(self, where, "dp", "mp", "pp", "cp", "ulysses_degree", "cluster_timeout_s")
        self.optimizer().check(where)
        Layout(cp=self.cp, cp_algo=self.cp_algo, ulysses_degree=self.ulysses_degree).check_context(where)
        if self.cp > 1 and self.parallel_mode not in ("semi_auto_parallel", "auto_parallel"):
            raise LabkitError(f"{where}.cp = {self.cp} needs parallel_mode semi_auto_parallel or auto_parallel, got "
                              f"{self.parallel_mode or 'null (data_parallel)'}: mindformers resets context_parallel "
                              "to 1 in the other modes (BaseTrainer._check_global_batch_size_for_auto_parallel)",
                              f"set {where}.parallel_mode: semi_auto_parallel, or {where}.cp: 1")

    def optimizer(self) -> OptimizerParallel:
        """How MindSpore shards when optimizer_shard is on."""
        return OptimizerParallel(level=self.optimizer_level,
                                 gradient_accumulation_shard=self.gradient_accumulation_shard,
                                 threshold_kb=self.optimizer_threshold_kb,
                                 weight_shard_size=self.optimizer_weight_shard_size,
                                 comm_recompute=self.optimizer_comm_recompute)


@dataclass
class RunConfig:
    """A whole training run, as in configs/*.yaml."""

    model: ModelConfig = field(default_factory=lambda: model_preset("tiny"))  # YAML: `preset: NAME` plus overrides,
    # or the ModelConfig fields
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output_dir: str = "runs/train"  # run folder (relative to where you run)

    def validate(self, where: str = ""):
        self.train.recompute.layers(self.model.num_layers)  # raises on layers the model does not have
        if self.train.recompute.mode == "selective":
            raise LabkitError("train.recompute = 'selective' is a planner mode: labkit's trainer recomputes whole "
                              "layers", "use none, all, last:K, first:K or A-B")

    def layout(self) -> Layout:
        """The run's parallel layout (dp None: 1)."""
        t, p = self.train, self.parallel
        return Layout(dp=p.dp or 1, mp=p.mp, pp=p.pp, cp=p.cp, cp_algo=p.cp_algo, ulysses_degree=p.ulysses_degree,
                      micro_batch=t.micro_batch, accum=t.accum, recompute=t.recompute,
                      optimizer_shard=p.optimizer_shard, optimizer=p.optimizer())

    def model_config(self) -> ModelConfig:
        """The model (`self.model`)."""
        return self.model


def load_run_config(path: str | Path | RunConfig | None = None, overrides: list[str] | tuple | None = None,
                    values: dict | None = None) -> RunConfig:
    """A RunConfig from YAML (or defaults, or a RunConfig) with `--set a.b=c` overrides, then `values` (dotted key
    -> typed value, e.g. flag_values(args)) applied, validated."""
    data = to_dict(path) if isinstance(path, RunConfig) else read_yaml(path) if path else {}
    for item in overrides or []:
        set_dotted(data, item)
    for key, value in (values or {}).items():
        set_value(data, key, value)
    where = str(path) if path and not isinstance(path, RunConfig) else "config"
    try:
        return load(RunConfig, data)
    except LabkitError as e:
        raise LabkitError(f"{where}: {e.what}", e.fix) from None


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


# Mixed-precision levels: the dtypes mindformers' LlamaConfig gets (compute_dtype, param_init_type,
# softmax_compute_type, layernorm_compute_type, embedding_init_type (None: param_init_type), rotary_dtype).
#   O0: everything float32.
#   O1: MindSpore's white-list casting (`ms.amp.auto_mixed_precision(net, "O1")`) on the float32 model.
#   O2: float16 compute on float32 weights, norms and softmax in float32 (`auto_mixed_precision(net, "O2")` breaks
#       the attention BatchMatMul's dtypes in mindformers 1.9.0, so the dtypes are set in the model instead).
#   O3: float16 everywhere, weights included.
#   fp16, bf16: mindformers' own Llama-2-7B pretraining recipes (r1.5.0 configs/llama2/pretrain_llama2_7b.yaml
#       and pretrain_llama2_7b_bf16.yaml): float16 weights (the bf16 recipe's embedding bfloat16), float32 norms,
#       float16 softmax, compute float16 / bfloat16. No float32 master copy: the AdamW moments are the only
#       float32 state (labkit.parallel.census counts what each level allocates).
# Every level computing in float16 uses dynamic loss scaling (loss_scaled); bfloat16 needs none.
AMP_LEVELS = {
    "O0": dict(compute_dtype="float32", param_dtype="float32", softmax_dtype="float32", norm_dtype="float32"),
    "O1": dict(compute_dtype="float32", param_dtype="float32", softmax_dtype="float32", norm_dtype="float32"),
    "O2": dict(compute_dtype="float16", param_dtype="float32", softmax_dtype="float32", norm_dtype="float32"),
    "O3": dict(compute_dtype="float16", param_dtype="float16", softmax_dtype="float16", norm_dtype="float16"),
    "fp16": dict(compute_dtype="float16", param_dtype="float16", softmax_dtype="float16", norm_dtype="float32",
                 rotary_dtype="float16"),
    "bf16": dict(compute_dtype="bfloat16", param_dtype="float16", softmax_dtype="float16", norm_dtype="float32",
                 embedding_dtype="bfloat16", rotary_dtype="float32"),
}


def loss_scaled(amp_level: str) -> bool:
    """Whether a level trains with dynamic loss scaling: every level that computes in float16 (O1's white list
    included); O0 and bfloat16 compute need none (bfloat16 has float32's exponent range)."""
    return amp_level != "O0" and AMP_LEVELS[amp_level]["compute_dtype"] != "bfloat16"
