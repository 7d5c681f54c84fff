"""Notebook 07's logic: one parameterised pretraining run, from the tiny CPU smoke run to Llama-2-7B on 8 cards.

    run = resolve(globals())   the notebook's parameters -> a validated PretrainRun, or a LabkitError naming the
                               parameter and the fix: layout (dp x mp x pp = devices), batch arithmetic
                               (micro_batch x dp x accum = global_batch), memory per the planner, what the device
                               target can run, the output folder and the files a run reads
    write_configs(run)         run.yaml (labkit), mindformers.yaml (the same run for mindformers'
                               run_mindformer.py), plan.json and launch.sh (the commands, per node) into output_dir
    launch(run)                `labkit launch` with a live view of loss, tokens/s, MFU and memory (metrics.jsonl)
    summarize(run, result)     final figures, checkpoints, how to resume; or, without devices, what was not done
    prove_shapes(run)          the model built from mindformers.yaml without weights: every name and shape checked

Parameters are the config fields' own names (PARAMETERS: one glossary for YAML, CLI, papermill and widgets).
A parameter left None takes the preset's config value; dp/mp/pp left None are chosen by the planner
(labkit.plan), which also judges memory: a layout that does not fit stops the notebook before anything starts.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .config import RunConfig, _coerce, load, load_run_config, set_dotted, to_dict
from .errors import LabkitError, LabkitFailure
from .paths import RUNS, atomic_write_text, lab_path


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # as written in the notebook's parameters cell
    default: object
    field: str | None  # the RunConfig field it sets (dotted); None = a notebook-only parameter
    help: str


PARAMETERS = (
    Param("preset", "str", "tiny", None, "tiny (CPU smoke run), llama2_7b (mindformers' 7B recipe, 8 x 64 GiB) or "
          "llama2_7b_seed (the seeds' 7B recipe, made to fit)"),
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
    "llama2_7b": dict(config="configs/llama2_7b_mindformers.yaml", devices=8, device="atlas_800t_a2"),
    "llama2_7b_seed": dict(config="configs/llama2_7b_seed.yaml", devices=8, device="atlas_800t_a2"),
}
DEVICE_FOR_TARGET = {"CPU": "cpu", "Ascend": "atlas_800t_a2", "GPU": "a100_80g"}
# how the planner counts each mixed-precision level: (precision, fp32 master weights)
AMP_PRECISION = {"O0": ("fp32", False), "O1": ("fp32", False), "O2": ("fp16", True), "O3": ("fp16", False)}
# what the seeds' reference configuration says, before the change configs/llama2_7b_seed.yaml ships
SEED_AS_WRITTEN = {"parallel.optimizer_shard": False, "parallel.parallel_mode": "data_parallel",
                   "train.micro_batch": 4, "train.accum": 16, "train.recompute": "last:16"}


@dataclass
class PretrainRun:
    preset: str
    cfg: RunConfig  # the complete run (output_dir absolute); what run.yaml holds
    model: object  # labkit.config.ModelConfig
    device: object  # labkit.devices.Device the planner used
    device_memory_gib: float
    devices: int
    nodes: int
    workers: int  # devices on this node
    node_rank: int
    master_addr: str | None
    master_port: int | None
    strategy: dict  # the planner's row for the chosen layout (memory_gib, step_time_s, tokens_per_s, mfu, fits)
    alternatives: list  # other layouts the planner judged, best first
    can_train: bool  # the devices are here
    why_not: str | None  # why this machine does not train
    output_dir: Path
    resume: bool = False
    overwrite: bool = False
    params: dict = field(default_factory=dict)  # the parameters as given
    sources: dict = field(default_factory=dict)  # parameter -> where its value came from

    @property
    def global_batch(self) -> int:
        return self.cfg.train.global_batch

    def describe(self) -> str:
        t, p, s = self.cfg.train, self.cfg.parallel, self.strategy
        m = s["memory_gib"]
        lines = [f"preset {self.preset}: {self.model.name}, {self.model.num_params:,} parameters; "
                 f"{self.devices} x {self.cfg.parallel.device_target} ({self.device.name}, "
                 f"{self.device_memory_gib:g} GiB each) on {self.nodes} node(s)",
                 f"layout: dp {p.dp} x mp {p.mp} x pp {p.pp} = {p.dp * p.mp * p.pp} devices "
                 f"({p.parallel_mode}, optimizer_shard {p.optimizer_shard})",
                 f"batch: micro_batch {t.micro_batch} x dp {p.dp} x accum {t.accum} = global_batch "
                 f"{t.global_batch} samples x {self.cfg.data.seq_len} tokens",
                 f"memory per device (planner): {m['total']:.1f} of {self.device_memory_gib:g} GiB = weights "
                 f"{m['weights']:.1f} + gradients {m['gradients']:.1f} + optimizer {m['optimizer']:.1f} + "
                 f"activations {m['activations']:.2f} + overhead {m['overhead']:.1f} -> "
                 + ("fits" if s["fits"] else "DOES NOT FIT"),
                 f"predicted: {s['step_time_s']:.3g} s/step, {s['tokens_per_s_per_device']:,.0f} tokens/s per "
                 f"device, MFU {s['mfu']:.0%}",
                 f"output: {self.output_dir}",
                 "will train here" if self.can_train else f"plan only, no training here: {self.why_not}"]
        derived = [f"  {k} = {getattr_dotted(self.cfg, PARAMS[k].field) if PARAMS[k].field else v[0]}  ({v[1]})"
                   for k, v in self.sources.items() if v[1] != "parameter"]
        return "\n".join(lines + ["where values came from (parameters left None):"] + derived)


def getattr_dotted(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------------------------------------- resolving


def _typed(name: str, value):
    import typing

    tp = eval(PARAMS[name].type, {"Optional": typing.Optional, "int": int, "float": float, "str": str, "bool": bool})
    try:
        return _coerce(value, tp, name)
    except LabkitError as e:
        raise LabkitError(f"parameter {e.what}", f"pass a value of type {PARAMS[name].type}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _caller_base() -> Path:
    """Where the user runs: papermill's kernel cwd, or the folder `labkit run` was called from."""
    from .runner import CALLER_ENV

    return Path(os.environ.get(CALLER_ENV) or os.getcwd())


def _user_path(p: str) -> Path:
    """A user path: absolute, relative to the caller, or a lab path (configs/, data/, runs/) from the lab root."""
    path = Path(p).expanduser()
    if path.is_absolute():
        return path
    mine = _caller_base() / path
    if mine.exists():
        return mine.resolve()
    lab = lab_path(p)
    return lab.resolve() if lab.exists() else mine


def recompute_fraction(spec: str, num_layers: int) -> float:
    from .train import parse_recompute

    return len(parse_recompute(spec, num_layers)) / num_layers


def estimate(model, device, memory_gib: float, *, devices: int, nodes: int, seq_len: int, dp: int, mp: int,
             pp: int, micro_batch: int, accum: int, recompute: str, optimizer_shard: bool, amp_level: str,
             flash_attention: bool) -> dict:
    """The planner's row for one layout. labkit recomputes whole layers (`last:K` etc.): memory and time are the
    planner's `none` and `full` rows weighted by the fraction of layers recomputed (activations are per layer)."""
    from . import plan as planner

    precision, master = AMP_PRECISION[amp_level]
    frac = recompute_fraction(recompute, model.num_layers)
    rows = {}
    for rc in {"none" if frac < 1 else "full", "full" if frac > 0 else "none"}:
        res = planner.plan(model, devices, memory_gib, device=device, seq_len=seq_len,
                           global_batch=micro_batch * dp * accum, precision=precision, master_weights=master,
                           nodes=nodes, flash_attention=flash_attention,
                           constraints=dict(dp=dp, mp=mp, pp=pp, micro_batch=micro_batch, accum=accum, recompute=rc,
                                            optimizer_shard=optimizer_shard))
        if not res["strategies"]:
            raise LabkitError(f"dp {dp} x mp {mp} x pp {pp} cannot run this model: "
                              + ("; ".join(res["skipped"]) or "no valid strategy"))
        rows[rc] = res["strategies"][0]
    lo, hi = rows.get("none", rows.get("full")), rows.get("full", rows.get("none"))
    mix = lambda a, b: a + (b - a) * frac  # noqa: E731
    mem = {k: round(mix(lo["memory_gib"][k], hi["memory_gib"][k]), 3) for k in lo["memory_gib"]}
    step = mix(lo["step_time_s"], hi["step_time_s"])
    tokens = micro_batch * dp * accum * seq_len
    row = {"dp": dp, "mp": mp, "pp": pp, "micro_batch": micro_batch, "accum": accum, "recompute": recompute,
           "optimizer_shard": optimizer_shard, "memory_gib": mem, "step_time_s": step, "tokens_per_s": tokens / step,
           "tokens_per_s_per_device": tokens / step / devices, "mfu": lo["mfu"] * lo["step_time_s"] / step,
           "fits": mem["total"] <= memory_gib}
    if not row["fits"]:
        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
        row["why_not"] = (f"needs {mem['total']:.1f} GiB > {memory_gib:g} GiB: model states {states:.1f} + "
                          f"activations {mem['activations']:.1f} + overhead {mem['overhead']:.1f}")
    return row


def _batch(g_fixed, mb_param, accum_param, mb_config: int, dp: int):
    """(micro_batch, accum, global_batch, None) for one dp, or (.., reason) when the arithmetic cannot work."""
    if g_fixed is None:  # micro_batch and accum both given: the global batch follows
        return mb_param, accum_param, mb_param * dp * accum_param, None
    if g_fixed % dp:
        return None, None, g_fixed, f"global_batch {g_fixed} is not divisible by dp {dp}"
    per = g_fixed // dp
    if mb_param is not None:
        if per % mb_param:
            return None, None, g_fixed, (f"micro_batch {mb_param} does not divide global_batch / dp = "
                                         f"{g_fixed} / {dp} = {per}")
        mb = mb_param
    else:
        mb = max(d for d in _divisors(per) if d <= max(1, mb_config))
    acc = per // mb
    if accum_param is not None and accum_param != acc:
        return None, None, g_fixed, (f"micro_batch {mb} x dp {dp} x accum {accum_param} = "
                                     f"{mb * dp * accum_param}, not global_batch {g_fixed}")
    return mb, acc, g_fixed, None


def _availability(target: str, workers: int) -> str | None:
    """None when this machine has the devices for its share of the run, else why not."""
    if target == "CPU":
        return None
    from .env import collect_hardware

    hw = collect_hardware()
    have = len(hw["npus"] if target == "Ascend" else hw["nvidia_gpus"])
    if have < workers:
        return f"this machine has {have} {target} device(s) and the run needs {workers} per node"
    return None


def resolve(namespace: dict, *, check_files: bool = True) -> PretrainRun:
    """Validate the parameters (names from PARAMETERS, read from `namespace`, e.g. the notebook's globals())."""
    from . import checkpoint
    from .devices import device_preset
    from .model import backend_flags

    os.environ.setdefault("GLOG_v", "3")  # MindSpore may be imported below (the CPU GEMM probe)
    given = {name: _typed(name, namespace.get(name, DEFAULTS[name])) for name in PARAMS}
    sources = {name: (value, "parameter") for name, value in given.items() if value is not None}
    preset = given["preset"]
    if preset not in PRESETS:
        raise LabkitError(f"parameter preset = {preset!r} is not known", f"use one of {', '.join(PRESETS)}")
    pre = PRESETS[preset]
    base = load_run_config(given["config"] or pre["config"],
                           [] if given["config"] else [f"{k}={v}" for k, v in pre.get("overrides", {}).items()])
    data = to_dict(base)
    for p in PARAMETERS:  # plain settings: the parameter wins, None keeps the config's value
        if p.field and given[p.name] is not None and p.name not in ("dp", "mp", "pp", "micro_batch", "accum",
                                                                    "global_batch", "output_dir"):
            set_dotted(data, f"{p.field}={json.dumps(given[p.name])}")
    cfg = load(RunConfig, data)  # validates types, schedule, recompute syntax later
    model = cfg.model_config()
    target = cfg.parallel.device_target
    if cfg.data.seq_len > model.max_position_embeddings:
        raise LabkitError(f"parameter seq_len = {cfg.data.seq_len} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}", f"use seq_len <= {model.max_position_embeddings}")
    recompute_fraction(cfg.train.recompute, model.num_layers)  # raises on a bad spec

    devices = given["devices"] or pre["devices"]
    if devices < 1:
        raise LabkitError(f"parameter devices = {devices} must be >= 1")
    same_target = target == base.parallel.device_target
    dev_name = given["device"] or (pre.get("device") if same_target else None) or DEVICE_FOR_TARGET[target]
    dev = device_preset(dev_name, measure=False)  # the CPU's GEMM peak is measured below, once validation passed
    nodes = given["nodes"] or (1 if target == "CPU" else max(1, math.ceil(devices / dev.devices_per_node)))
    if devices % nodes:
        raise LabkitError(f"devices {devices} do not split evenly over nodes {nodes}",
                          "choose nodes dividing devices (every node runs the same number of workers)")
    workers = devices // nodes
    if not 0 <= given["node_rank"] < nodes:
        raise LabkitError(f"parameter node_rank = {given['node_rank']} is outside 0..{nodes - 1}")
    where = _availability(target, workers)
    if nodes > 1 and where is None and not (given["master_addr"] and given["master_port"]):
        raise LabkitError(f"nodes = {nodes} needs master_addr and master_port (node 0's host and a free port)",
                          "pass -p master_addr HOST -p master_port PORT, the same on every node")
    memory = given["device_memory_gib"] or (
        round(_host_ram_gib() / workers, 1) if dev.name == "cpu" else dev.memory_gib)
    if given["device_memory_gib"] is None:
        sources["device_memory_gib"] = (memory, "host RAM / workers" if dev.name == "cpu" else f"device {dev.name}")

    # the layout: dp x mp x pp = devices, each pinned or searched
    dp_, mp_, pp_ = given["dp"], given["mp"], given["pp"]
    pinned = [(n, v) for n, v in (("dp", dp_), ("mp", mp_), ("pp", pp_)) if v is not None]
    product = math.prod(v for _, v in pinned) if pinned else 1
    if any(v < 1 for _, v in pinned):
        raise LabkitError(f"parameters dp/mp/pp must be >= 1, got {dict(pinned)}")
    if (len(pinned) == 3 and product != devices) or devices % product:
        shown = " x ".join(f"{n} {v}" for n, v in pinned)
        tail = (f" = {product} != {devices}" if len(pinned) == 3 else
                (f" = {product}" if len(pinned) > 1 else "") + f" does not divide {devices}")
        raise LabkitError(f"dp x mp x pp must equal devices ({devices}): {shown}{tail}",
                          f"choose values whose product is {devices} (e.g. dp {devices}), or leave dp/mp/pp None "
                          "for the planner's best")
    if target == "CPU" and ((mp_ or 1) > 1 or (pp_ or 1) > 1):
        raise LabkitError(f"mp {mp_} / pp {pp_} need semi_auto_parallel, which MindSpore 2.9 refuses on CPU",
                          "on CPU use data parallel only (mp 1, pp 1), or device_target Ascend/GPU")
    shard = cfg.parallel.optimizer_shard
    if devices == 1 and shard:
        shard = False
        sources["optimizer_shard"] = (False, "one device: nothing to shard over")
    if target == "CPU" and shard:
        raise LabkitError("optimizer_shard needs MindSpore's parallel optimizer (semi_auto_parallel), which is "
                          "refused on CPU", "pass -p optimizer_shard False, or run on Ascend/GPU")
    t = cfg.train
    mb_param, acc_param, g_param = given["micro_batch"], given["accum"], given["global_batch"]
    for name, v in (("micro_batch", mb_param), ("accum", acc_param), ("global_batch", g_param)):
        if v is not None and v < 1:
            raise LabkitError(f"parameter {name} = {v} must be >= 1")
    config_dp = base.parallel.dp or max(1, pre["devices"] // (base.parallel.mp * base.parallel.pp))
    g_fixed = g_param or (None if mb_param and acc_param else
                          t.global_batch or t.micro_batch * t.accum * config_dp)
    flash = backend_flags(target).use_flash_attention
    dev = device_preset(dev_name)
    rows, reasons = [], {}
    for m in _divisors(devices):
        for q in _divisors(devices // m):
            d = devices // m // q
            if (dp_ and d != dp_) or (mp_ and m != mp_) or (pp_ and q != pp_) or (target == "CPU" and m * q > 1):
                continue
            mb, acc, g, why = _batch(g_fixed, mb_param, acc_param, t.micro_batch, d)
            if why is None:
                try:
                    rows.append(estimate(model, dev, memory, devices=devices, nodes=nodes, seq_len=cfg.data.seq_len,
                                         dp=d, mp=m, pp=q, micro_batch=mb, accum=acc, recompute=t.recompute,
                                         optimizer_shard=shard and d > 1, amp_level=t.amp_level,
                                         flash_attention=flash))
                except LabkitError as e:
                    why = e.what
            if why:
                reasons[f"dp {d} x mp {m} x pp {q}"] = why
    if not rows:
        raise LabkitError("no parallel layout passes the batch arithmetic: "
                          + "; ".join(f"{k}: {v}" for k, v in reasons.items()),
                          "micro_batch x dp x accum must equal global_batch: change micro_batch/accum/"
                          "global_batch, or leave micro_batch and accum None to derive them")
    rows.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"], -r["dp"]))
    best = rows[0]
    if not best["fits"]:
        raise LabkitError(f"the planner says no layout fits in {memory:g} GiB per device: {best['why_not']} "
                          f"(dp {best['dp']} x mp {best['mp']} x pp {best['pp']}, micro_batch "
                          f"{best['micro_batch']}, recompute {best['recompute']}, optimizer_shard "
                          f"{best['optimizer_shard']})",
                          _memory_fix(model, dev, memory, devices, nodes, cfg, g_fixed or best["micro_batch"] *
                                      best["dp"] * best["accum"], target, flash))
    for name, key in (("dp", "dp"), ("mp", "mp"), ("pp", "pp")):
        if given[name] is None:
            sources[name] = (best[key], f"planner's best of {sum(r['fits'] for r in rows)} fitting layouts")
    how = {"micro_batch": "config" if best["micro_batch"] == t.micro_batch else
           f"config's {t.micro_batch}, lowered to divide global_batch / dp",
           "accum": "global_batch / (micro_batch x dp)", "global_batch": "config" if g_fixed else "micro_batch x dp x accum"}
    for name in ("micro_batch", "accum", "global_batch"):
        if given[name] is None:
            sources[name] = (None, how[name])
    if shard and not best["optimizer_shard"]:
        shard = False

    # parallel mode and the final config
    if devices == 1:
        mode = "stand_alone"
    elif target == "CPU":
        mode = "data_parallel"
    elif base.parallel.parallel_mode in ("semi_auto_parallel", "auto_parallel"):
        mode = base.parallel.parallel_mode
    else:
        mode = "semi_auto_parallel" if (best["mp"] > 1 or best["pp"] > 1 or shard) else "data_parallel"
    for key, value in (("parallel.dp", best["dp"]), ("parallel.mp", best["mp"]), ("parallel.pp", best["pp"]),
                       ("parallel.optimizer_shard", shard), ("parallel.parallel_mode", mode),
                       ("train.micro_batch", best["micro_batch"]), ("train.accum", best["accum"]),
                       ("train.global_batch", best["micro_batch"] * best["dp"] * best["accum"])):
        set_dotted(data, f"{key}={json.dumps(value)}")
    scratch = given["output_dir"] is None
    out = (RUNS / "pretrain" / preset) if scratch else _caller_base() / Path(given["output_dir"]).expanduser()
    data["output_dir"] = str(out.resolve())
    run = PretrainRun(preset=preset, cfg=None, model=model, device=dev, device_memory_gib=memory, devices=devices,
                      nodes=nodes, workers=workers, node_rank=given["node_rank"], master_addr=given["master_addr"],
                      master_port=given["master_port"], strategy=best, alternatives=rows[1:],
                      can_train=where is None, why_not=where, output_dir=out.resolve(), resume=given["resume"],
                      overwrite=given["overwrite"] or scratch, params=given, sources=sources)
    for key in ("dataset", "tokenizer", "init_checkpoint"):
        section = "train" if key == "init_checkpoint" else "data"
        if data[section].get(key):
            data[section][key] = str(_user_path(data[section][key]))
    run.cfg = load(RunConfig, data)
    if check_files and run.can_train:
        _check_files(run, checkpoint)
    return run


def _host_ram_gib() -> float:
    import psutil

    from .devices import GIB

    return psutil.virtual_memory().total / GIB


def _check_files(run: PretrainRun, checkpoint) -> None:
    c = run.cfg
    for what, value, need in (("dataset", c.data.dataset, "a MindRecord folder from `labkit data build`"),
                              ("tokenizer", c.data.tokenizer, "a tokenizer folder with tokenizer.model"),
                              ("init_checkpoint", c.train.init_checkpoint, "a `labkit convert hf2ms` output")):
        if value and not Path(value).exists():
            raise LabkitError(f"parameter {what} = {run.params.get(what) or value} not found (looked at {value})",
                              f"give {need}; relative paths start where you run, configs/ and data/ at the lab root")
    out = run.output_dir
    has_run = bool(checkpoint.list_checkpoints(out)) or (out / "metrics.jsonl").exists()
    if run.resume:
        ck = checkpoint.latest(out)
        if ck is None:
            raise LabkitError(f"resume = True but {out} holds no complete checkpoint",
                              "run once without resume first, or point output_dir at the earlier run")
        step = int(ck.name.split("_")[1])
        if step >= c.train.steps:
            raise LabkitError(f"resume: the newest checkpoint is step {step}, already at steps {c.train.steps}",
                              f"pass -p steps N with N > {step} to train further")
    elif has_run and not run.overwrite:
        raise LabkitError(f"output_dir {out} already holds a run",
                          "continue it with -p resume True, start over with -p overwrite True, or choose another "
                          "output_dir")


def _memory_fix(model, dev, memory, devices, nodes, cfg, global_batch, target, flash) -> str:
    """The planner's fastest fitting strategy for these devices, as parameters to pass."""
    from . import plan as planner

    precision, master = AMP_PRECISION[cfg.train.amp_level]
    found = []
    for rc in ("none", "full"):
        cons = {"recompute": rc, **({"mp": 1, "pp": 1} if target == "CPU" else {})}
        if target == "CPU":
            cons["optimizer_shard"] = False
        res = planner.plan(model, devices, memory, device=dev, seq_len=cfg.data.seq_len, global_batch=global_batch,
                           precision=precision, master_weights=master, nodes=nodes, flash_attention=flash,
                           constraints=cons)
        found += [r for r in res["strategies"] if r["fits"]]
        why = res["why"]
    if not found:
        return f"the planner finds no fitting strategy at all: {why}"
    b = max(found, key=lambda r: r["tokens_per_s"])
    rc = {"none": "none", "full": "all"}[b["recompute"]]
    return (f"the planner's fastest fitting strategy for global_batch {global_batch}: -p dp {b['dp']} -p mp "
            f"{b['mp']} -p pp {b['pp']} -p micro_batch {b['micro_batch']} -p recompute {rc} -p optimizer_shard "
            f"{b['optimizer_shard']} ({b['memory_gib']['total']:.1f} GiB)")


def layout_table(run: PretrainRun, top: int = 8):
    """The chosen layout and the planner's next best ones as a DataFrame."""
    import pandas as pd

    rows = [run.strategy] + run.alternatives[:top - 1]
    return pd.DataFrame([{"chosen": r is run.strategy, "dp": r["dp"], "mp": r["mp"], "pp": r["pp"],
                          "micro_batch": r["micro_batch"], "accum": r["accum"], "recompute": r["recompute"],
                          "optimizer_shard": r["optimizer_shard"], "GiB/device": r["memory_gib"]["total"],
                          "fits": r["fits"], "s/step": round(r["step_time_s"], 3),
                          "tokens/s/device": round(r["tokens_per_s_per_device"]), "MFU": round(r["mfu"], 3)}
                         for r in rows])


# ---------------------------------------------------------------------------------------------- writing


def stage_recompute_counts(spec: str, num_layers: int, pp: int) -> list[int]:
    """Layers recomputed per pipeline stage. mindformers' `recompute: [n, ...]` recomputes the FIRST n layers of
    each stage (LayerSetting in 1.9.0); with equal layers per stage that stores the same activations as any
    other n layers of the stage, so `last:16` becomes [16] with one stage."""
    from .train import parse_recompute

    per = num_layers // pp
    idx = parse_recompute(spec, num_layers)
    return [sum(1 for i in idx if s * per <= i < (s + 1) * per) for s in range(pp)]


def mindformers_yaml(run: PretrainRun) -> str:
    """The same run as a mindformers run YAML (keys as in r1.5.0 configs/llama2/pretrain_llama2_7b.yaml, types
    available in the installed mindformers 1.9.0)."""
    import yaml

    from . import plan as planner
    from .model import llama_config_kwargs
    from .train import AMP_LEVELS

    c, t, p, s = run.cfg, run.cfg.train, run.cfg.parallel, run.strategy
    frac = recompute_fraction(t.recompute, run.model.num_layers)
    mode = p.parallel_mode if p.parallel_mode in planner.PARALLEL_MODES else "data_parallel"
    par = yaml.safe_load(planner.mindformers_parallel_yaml(
        {**s, "recompute": "full" if frac == 1 else "none"}, parallel_mode=mode, search_mode=p.search_mode))
    if 0 < frac < 1:
        par["recompute_config"]["recompute"] = stage_recompute_counts(t.recompute, run.model.num_layers, p.pp)
    par["use_parallel"] = run.devices > 1
    dataset = {"data_loader": {"type": "MindDataset", "dataset_dir": c.data.dataset or "", "shuffle": c.data.shuffle},
               "input_columns": ["input_ids"], "num_parallel_workers": c.data.num_parallel_workers,
               "python_multiprocessing": False, "drop_remainder": True, "batch_size": t.micro_batch, "repeat": 1,
               "numa_enable": False, "prefetch_size": c.data.prefetch}
    scale = 1.0 if t.amp_level == "O0" else {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": t.loss_scale,
                                              "scale_factor": t.scale_factor, "scale_window": t.scale_window}
    context = {"mode": 0 if t.mode == "graph" else 1, "device_target": p.device_target, "max_call_depth": 10000,
               "save_graphs": False, "device_id": 0}
    if p.device_target != "CPU":
        context["max_device_memory"] = f"{max(1.0, run.device_memory_gib - run.device.overhead_gib):g}GB"
    doc = {
        "seed": t.seed, "output_dir": "./output", "run_mode": "train", "load_checkpoint": t.init_checkpoint or "",
        "auto_trans_ckpt": False, "resume_training": run.resume, "src_strategy_path_or_dir": "",
        "trainer": {"type": "CausalLanguageModelingTrainer", "model_name": run.model.name},
        "runner_config": {"epochs": 1, "batch_size": t.micro_batch, "sink_mode": True, "sink_size": 1,
                          **par.pop("runner_config")},
        "optimizer": {"type": "AdamW", "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay},
        "lr_schedule": {"type": "CosineWithWarmUpLR", "learning_rate": t.lr, "lr_end": t.min_lr,
                        "warmup_steps": t.warmup_steps, "total_steps": t.decay_steps},
        "train_dataset": dataset,
        "train_dataset_task": {"type": "CausalLanguageModelDataset", "dataset_config": dataset},
        **par,
        "context": context,
        "model": {"model_config": {"type": "LlamaConfig", **llama_config_kwargs(
            run.model, seq_length=c.data.seq_len, batch_size=t.micro_batch, device_target=p.device_target,
            **AMP_LEVELS[t.amp_level])}, "arch": {"type": "LlamaForCausalLM"}},
        "processor": {"return_tensors": "ms", "type": "LlamaProcessor",
                      "tokenizer": {"type": "LlamaTokenizer", "pad_token": "<unk>",
                                    "vocab_file": str(Path(c.data.tokenizer) / "tokenizer.model")}},
        "runner_wrapper": {"type": "MFTrainOneStepCell", "scale_sense": scale, "use_clip_grad": t.grad_clip > 0,
                           "max_grad_norm": t.grad_clip or 1.0},
        "callbacks": [{"type": "MFLossMonitor"},
                      {"type": "CheckpointMonitor", "prefix": run.model.name, "integrated_save": False,
                       "save_checkpoint_steps": t.save_every or t.steps, "keep_checkpoint_max": t.keep_checkpoints}],
    }
    head = (f"# mindformers run YAML for the run in run.yaml beside this file (written by labkit.pretrain).\n"
            f"# Start: see launch.sh. Differences from labkit's own loop: mindformers trains `epochs` passes over\n"
            f"# the dataset (no step limit: choose epochs x samples / global batch {t.global_batch} ~ steps "
            f"{t.steps});\n# recompute [n] recomputes the first n layers of each pipeline stage (labkit: "
            f"{t.recompute!r}, the same memory).\n")
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def commands(run: PretrainRun) -> dict:
    """The exact commands for this run: labkit launch per node, the msrun line it runs, mindformers', papermill's."""
    from .launch import LaunchPlan, command

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
    pl = LaunchPlan(cfg=c, workers=run.workers, nodes=run.nodes, node_rank=run.node_rank, total=run.devices,
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
    return {"labkit_launch": labkit, "msrun": msrun, "mindformers": mindformers, "papermill": shlex.join(pm),
            "resume": resume}


def write_configs(run: PretrainRun) -> dict[str, Path]:
    """run.yaml, mindformers.yaml, plan.json and launch.sh in output_dir (each written atomically)."""
    from .config import dump_run_config

    out = run.output_dir
    cmds = commands(run)
    given = {k: v for k, v in run.params.items() if v is not None and v != DEFAULTS[k]}
    files = {
        "run.yaml": f"# labkit run config written by notebook 07 (preset {run.preset}, parameters {given}).\n"
                    f"# Start it with: {cmds['labkit_launch'][run.node_rank]}\n" + dump_run_config(run.cfg),
        "mindformers.yaml": mindformers_yaml(run),
        "plan.json": json.dumps({"preset": run.preset, "devices": run.devices, "nodes": run.nodes,
                                 "device": run.device.name, "device_memory_gib": run.device_memory_gib,
                                 "strategy": run.strategy, "alternatives": run.alternatives[:10],
                                 "can_train_here": run.can_train, "why_not": run.why_not}, indent=1, default=str),
        "launch.sh": "\n".join(
            ["#!/bin/sh", f"# Commands for this run ({run.devices} devices on {run.nodes} node(s)).", "",
             "# labkit (what notebook 07 runs), one line per node:"] + cmds["labkit_launch"] +
            ["", "# the command labkit launch runs on this node:", "# " + cmds["msrun"], "",
             "# the same run with mindformers' own launcher (from a mindformers checkout):", "# " + cmds["mindformers"],
             "", "# this notebook again, e.g. on a cluster:", "# " + cmds["papermill"], "",
             "# continue after an interruption:", "# " + cmds["resume"], ""]),
    }
    return {name: atomic_write_text(out / name, text) for name, text in files.items()}


# ---------------------------------------------------------------------------------------------- running


PANELS = (("loss", "loss", 1), ("tokens_per_s", "tokens/s", 1), ("mfu", "MFU %", 100), ("peak_mem_mb", "peak memory MB", 1))


def figure_png(rows: list[dict], title: str = "") -> bytes:
    """Loss, throughput, MFU and memory by step as PNG bytes (matplotlib's object API: safe off the main thread)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 3))
    FigureCanvasAgg(fig)
    for i, (key, label, scale) in enumerate(PANELS):
        ax = fig.add_subplot(1, len(PANELS), i + 1)
        pts = [(r["step"], r[key] * scale) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    return buf.getvalue()


class _Text:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def status_line(rows: list[dict], steps: int) -> str:
    if not rows:
        return f"waiting for step 1 of {steps} (imports, dataset, graph compilation) ..."
    r = rows[-1]
    return (f"step {r['step']}/{steps}  loss {r['loss']:.4f}  {r['tokens_per_s']:,.0f} tokens/s  MFU {r['mfu']:.1%}  "
            f"peak memory {r['peak_mem_mb']:,.0f} MB  lr {r['lr']:.2e}")


class Follower(threading.Thread):
    """Reads rank 0's metrics.jsonl every `every` seconds and updates two display handles (a status line and the
    figure) in place; under papermill the last state is what the executed notebook keeps."""

    def __init__(self, metrics: Path, steps: int, every: float = 2.0):
        super().__init__(daemon=True)
        from IPython.display import Image, display

        self.metrics, self.steps, self.every, self.seen = Path(metrics), steps, every, -1
        self._stop_event = threading.Event()
        self.status = display(_Text(status_line([], steps)), display_id=True)
        self.plot = display(Image(data=figure_png([])), display_id=True)

    def refresh(self) -> None:
        from IPython.display import Image

        from .metrics import read_metrics

        rows = read_metrics(self.metrics.parent)
        if len(rows) != self.seen:
            self.seen = len(rows)
            self.status.update(_Text(status_line(rows, self.steps)))
            self.plot.update(Image(data=figure_png(rows)))

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            try:
                self.refresh()
            except Exception:  # a half-written line or a display hiccup must not end the run
                pass

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        self.refresh()


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


def launch(run: PretrainRun, *, live: bool | None = None, timeout: float | None = None):
    """Start the run through `labkit launch` (one worker: `labkit train` in a child process; more: msrun) and
    follow it live. Returns the LaunchResult; a failed run raises LabkitFailure with the failing rank's log."""
    from . import launch as launcher

    if not run.can_train:
        raise LabkitError(f"this machine cannot run it: {run.why_not}", "see launch.sh for the commands to use")
    if not (run.output_dir / "run.yaml").exists():
        write_configs(run)
    live = _in_notebook() if live is None else live
    follower = Follower(run.output_dir / "metrics.jsonl", run.cfg.train.steps) if live else None
    if follower:
        follower.start()
    try:
        res = launcher.launch(run.cfg, run.workers, output=str(run.output_dir), nodes=run.nodes,
                              node_rank=run.node_rank, master_addr=run.master_addr, master_port=run.master_port,
                              resume=run.resume, overwrite=run.overwrite and not run.resume, progress=not live,
                              timeout=timeout, show_report=False, log=lambda m: print(m, file=sys.stderr))
    finally:
        if follower:
            follower.stop()
    if not res.ok:
        raise LabkitFailure(f"the run failed: {res.reason}", res.report())
    return res


# ---------------------------------------------------------------------------------------------- results


def expected_shapes(model) -> dict[str, tuple]:
    """mindformers parameter names and shapes the model config implies: HF's canonical shapes renamed by the
    conversion mapping (labkit.convert), an independent derivation of what mindformers builds."""
    from .convert import expected_hf_shapes, hf_to_ms

    return {hf_to_ms(k): v for k, v in expected_hf_shapes(model).items()}


def prove_shapes(run: PretrainRun) -> dict:
    """Build the model from the written mindformers.yaml without allocating weights (mindformers' own
    MindFormerConfig + LlamaConfig + LlamaForCausalLM) and compare every name and shape with expected_shapes."""
    import time

    from .model import count_parameters, quiet_mindformers

    quiet_mindformers()
    import mindspore as ms
    from mindformers import LlamaConfig, LlamaForCausalLM
    from mindformers.tools.register import MindFormerConfig

    path = run.output_dir / "mindformers.yaml"
    if not path.exists():
        write_configs(run)
    mc = dict(MindFormerConfig(str(path)).model.model_config)
    mc.pop("type")
    start = time.perf_counter()
    with ms.nn.utils.no_init_parameters():
        model = LlamaForCausalLM(config=LlamaConfig(**mc))
    built = {n: tuple(p.shape) for n, p in model.parameters_and_names()}
    want = expected_shapes(run.model)
    wrong = {n: (built.get(n), s) for n, s in want.items() if built.get(n) != s}
    return {"parameters": count_parameters(model), "expected": run.model.num_params, "tensors": len(built),
            "mismatched": wrong, "unexpected": sorted(set(built) - set(want)),
            "seconds": round(time.perf_counter() - start, 2), "from": str(path)}


def checkpoint_shapes(run: PretrainRun) -> dict:
    """The trained run's newest checkpoint against expected_shapes: what the workers really built and saved."""
    from . import checkpoint

    ck = checkpoint.latest(run.output_dir)
    if ck is None:
        raise LabkitError(f"no checkpoint in {run.output_dir}", "train first (the launch cell)")
    saved = {n: tuple(w.shape) for n, w in checkpoint.load_weights(ck).items()}
    want = expected_shapes(run.model)
    wrong = {n: (saved.get(n), s) for n, s in want.items() if saved.get(n) != s}
    return {"checkpoint": str(ck), "parameters": sum(math.prod(saved[n]) for n in want if n in saved),
            "expected": run.model.num_params, "tensors": len(want), "mismatched": wrong}


def summarize(run: PretrainRun, result=None) -> dict:
    """What the run did: final metrics, the static figure, checkpoints and how to resume; or, when nothing was
    trained here, the predicted figures and the commands. Key figures are recorded for `labkit run`."""
    from . import checkpoint, nb
    from .metrics import health, read_metrics, steady

    cmds = commands(run)
    s = run.strategy
    out = {"trained": result is not None, "preset": run.preset, "devices": run.devices,
           "predicted_tokens_per_s_per_device": round(s["tokens_per_s_per_device"], 1),
           "predicted_mfu": round(s["mfu"], 3), "memory_gib_per_device": s["memory_gib"]["total"],
           "files": sorted(p.name for p in run.output_dir.glob("*") if p.is_file()), "commands": cmds}
    if result is None:
        tokens = run.global_batch * run.cfg.data.seq_len * run.cfg.train.steps
        out.update(trained_here=False, why_not=run.why_not,
                   predicted_days=round(run.cfg.train.steps * s["step_time_s"] / 86400, 1), tokens=tokens)
        print(f"NOT TRAINED on this machine: {run.why_not}.\nWhat was done: the plan was validated "
              f"({s['memory_gib']['total']:.1f} of {run.device_memory_gib:g} GiB per device), the configs were "
              f"written to {run.output_dir}, the model was built without weights to check its shapes.\n"
              f"Predicted on {run.devices} x {run.device.name}: {s['step_time_s']:.2f} s/step, "
              f"{s['tokens_per_s_per_device']:,.0f} tokens/s per device, MFU {s['mfu']:.0%}; {run.cfg.train.steps:,} "
              f"steps ({tokens / 1e9:,.1f}B tokens) in about {out['predicted_days']} days.\n"
              f"To train, on each node ({run.nodes}):\n  " + "\n  ".join(cmds["labkit_launch"]))
        nb.record("07 trained", False)
        nb.record("07 predicted MFU", f"{s['mfu']:.0%}")
        return out
    rows = read_metrics(run.output_dir)
    ck = checkpoint.list_checkpoints(run.output_dir)
    out.update(trained_here=True, steps=rows[-1]["step"], first_loss=rows[0]["loss"], final_loss=rows[-1]["loss"],
               tokens_per_s=steady(rows, "tokens_per_s"), mfu=steady(rows, "mfu"),
               peak_mem_mb=max(r["peak_mem_mb"] for r in rows), health=health(rows, run.cfg.train.grad_norm_alert),
               checkpoints=[str(p) for p in ck], seconds=round(result.seconds, 1))
    try:
        from IPython.display import Image, display

        display(Image(data=figure_png(rows, f"{run.preset}: {run.devices} worker(s), global batch "
                                            f"{run.global_batch}")))
    except ImportError:
        pass
    print(f"trained steps {rows[0]['step']}..{out['steps']} in {out['seconds']} s on {run.devices} worker(s): loss "
          f"{out['first_loss']:.4f} -> {out['final_loss']:.4f}; {out['tokens_per_s']:,.0f} tokens/s (after step 1), "
          f"MFU {out['mfu']:.1%} of this machine's measured GEMM peak; peak memory {out['peak_mem_mb']:,.0f} MB "
          f"(rank 0)\nhealth: {out['health']['verdict']}\ncheckpoints: " + ", ".join(p.name for p in ck) +
          f"\nresume: {cmds['resume']}  (or run this notebook with -p output_dir {run.output_dir} -p resume True "
          f"-p steps N)")
    nb.record("07 final loss", round(out["final_loss"], 3))
    nb.record("07 tokens/s", round(out["tokens_per_s"]))
    nb.record("07 MFU", f"{out['mfu']:.1%}")
    return out


# ---------------------------------------------------------------------------------------------- the 7B recipes


def recipe_row(name: str, config: str, overrides: dict | None = None, *, devices: int = 8,
               device: str = "atlas_800t_a2", memory_gib: float | None = None, tokens: float = 100e9) -> dict:
    """One shipped recipe judged by the planner on `devices` x `device`, as the config says (no search)."""
    from .devices import device_preset
    from .model import backend_flags

    cfg = load_run_config(config, [f"{k}={json.dumps(v)}" for k, v in (overrides or {}).items()])
    model, t, p = cfg.model_config(), cfg.train, cfg.parallel
    dev = device_preset(device)
    memory = memory_gib or dev.memory_gib
    dp = p.dp or devices // (p.mp * p.pp)
    row = estimate(model, dev, memory, devices=devices, nodes=max(1, devices // dev.devices_per_node),
                   seq_len=cfg.data.seq_len, dp=dp, mp=p.mp, pp=p.pp, micro_batch=t.micro_batch, accum=t.accum,
                   recompute=t.recompute, optimizer_shard=p.optimizer_shard, amp_level=t.amp_level,
                   flash_attention=backend_flags(p.device_target if device != "cpu" else "CPU").use_flash_attention)
    m = row["memory_gib"]
    tokens_per_step = t.micro_batch * dp * t.accum * cfg.data.seq_len
    return {"recipe": name, "device": f"{devices} x {dev.name} ({memory:g} GiB)",
            "global batch": f"{t.micro_batch} x {dp} x {t.accum} = {t.micro_batch * dp * t.accum}",
            "tokens/step": tokens_per_step, "amp": t.amp_level, "recompute": t.recompute,
            "optimizer_shard": p.optimizer_shard, "lr": f"{t.lr:g} -> {t.min_lr:g}, warmup {t.warmup_steps}",
            "model states GiB": round(m["weights"] + m["gradients"] + m["optimizer"], 1),
            "activations GiB": round(m["activations"], 1), "total GiB": round(m["total"], 1), "fits": row["fits"],
            "step s": round(row["step_time_s"], 2), "tokens/s/device": round(row["tokens_per_s_per_device"]),
            "MFU": round(row["mfu"], 3),
            f"days for {tokens / 1e9:g}B tokens": round(tokens / row["tokens_per_s"] / 86400, 1)}


def compare_recipes(tokens: float = 100e9) -> list[dict]:
    """mindformers' recipe and the seeds' (as written, the two changes, as shipped) on the lab's 7B hardware
    (8 x Atlas 800T A2, 64 GiB), and the seeds' on their own (8 x A100 80 GB, no flash attention on GPU)."""
    seed, mb4 = "configs/llama2_7b_seed.yaml", {"train.micro_batch": 4, "train.accum": 16}
    gpu = {"parallel.device_target": "GPU"}
    return [recipe_row("mindformers", "configs/llama2_7b_mindformers.yaml", tokens=tokens),
            recipe_row("seed as written", seed, SEED_AS_WRITTEN, tokens=tokens),
            recipe_row("seed + optimizer_shard", seed, {**mb4}, tokens=tokens),
            recipe_row("seed + optimizer_shard + recompute all", seed, {**mb4, "train.recompute": "all"},
                       tokens=tokens),
            recipe_row("seed as shipped", seed, tokens=tokens),
            recipe_row("seed as written", seed, {**SEED_AS_WRITTEN, **gpu}, tokens=tokens, device="a100_80g"),
            recipe_row("seed as shipped", seed, gpu, tokens=tokens, device="a100_80g")]
