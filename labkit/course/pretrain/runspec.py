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
(labkit.parallel.planner), which also judges memory: a layout that does not fit stops the notebook before anything
starts. resolve() runs in stages, each checking its part and returning a frozen dataclass: Settings (the typed
parameters and the config they give), Placement (devices, nodes, memory), Pinned (what the parameters fix of the
layout and the batch), Search (the planner's rows, best first); then the final config.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from labkit.config import RunConfig, coerce, load, load_run_config, set_value, to_dict
from labkit.course.pretrain.params import DEFAULTS, DEVICE_FOR_TARGET, PARAMETERS, PARAMS, PRESETS
from labkit.course.pretrain.planner_view import divisors, estimate, shortfall, split_batch
from labkit.course.runner import CALLER_ENV
from labkit.errors import LabkitError
from labkit.layout import Layout
from labkit.model.llama import backend_flags
from labkit.model.shapes import num_params
from labkit.parallel import planner
from labkit.parallel.devices import GIB, device_preset
from labkit.parallel.memory import Numerics
from labkit.parallel.planner import FIT_MARGIN_GIB, Machine
from labkit.paths import RUNS, lab_path
from labkit.runtime import prepare_process
from labkit.training import checkpoint, run_dir


@dataclass
class PretrainRun:
    preset: str
    cfg: RunConfig  # the complete run (output_dir absolute); what run.yaml holds
    model: object  # labkit.config.ModelConfig
    device: object  # labkit.parallel.devices.Device the planner used
    device_memory_gib: float
    devices: int
    nodes: int
    workers: int  # devices on this node
    node_rank: int
    master_addr: str | None
    master_port: int | None
    strategy: object  # labkit.parallel.planner.Strategy of the chosen layout (memory_gib, step_time_s, mfu, fits)
    alternatives: list  # other layouts' Strategy the planner judged, best first
    can_train: bool  # the devices are here
    why_not: str | None  # why this machine does not train
    output_dir: Path
    resume: bool = False
    overwrite: bool = False
    resume_from: Path | None = None  # mindformers launcher: an earlier run's checkpoint folder (rank_N folders)
    resume_strategy: Path | None = None  # that run's strategy folder, when its layout differs (auto_trans_ckpt)
    params: dict = field(default_factory=dict)  # the parameters as given
    sources: dict = field(default_factory=dict)  # parameter -> where its value came from

    @property
    def global_batch(self) -> int:
        return self.cfg.train.global_batch

    def describe(self) -> str:
        t, p, s = self.cfg.train, self.cfg.parallel, self.strategy
        m = s.memory_gib
        lines = [f"preset {self.preset}: {self.model.name}, {num_params(self.model):,} parameters; "
                 f"{self.devices} x {self.cfg.parallel.device_target} ({self.device.name}, "
                 f"{self.device_memory_gib:g} GiB each) on {self.nodes} node(s)",
                 f"layout: dp {p.dp} x mp {p.mp} x pp {p.pp}" + (f" x cp {p.cp} ({p.cp_algo})" if p.cp > 1 else "")
                 + f" = {p.dp * p.mp * p.pp * p.cp} devices "
                 f"({p.parallel_mode}, optimizer_shard {p.optimizer_shard}"
                 + (f", {p.optimizer_level})" if p.optimizer_shard else ")") + f", amp_level {t.amp_level}",
                 f"batch: micro_batch {t.micro_batch} x dp {p.dp} x accum {t.accum} = global_batch "
                 f"{t.global_batch} samples x {self.cfg.data.seq_len} tokens",
                 f"memory per device (planner): {m['total']:.1f} of {self.device_memory_gib:g} GiB = weights "
                 f"{m['weights']:.1f} + gradients {m['gradients']:.1f} + optimizer {m['optimizer']:.1f} + "
                 f"weight copies {m['copies']:.1f} + activations {m['activations']:.2f} + overhead "
                 f"{m['overhead']:.1f} -> " + ("fits" if s.fits else "DOES NOT FIT")
                 + f" (with {FIT_MARGIN_GIB:g} GiB of the pool to spare)",
                 f"predicted: {s.step_time_s:.3g} s/step, {s.tokens_per_s_per_device:,.0f} tokens/s per "
                 f"device, MFU {s.mfu:.0%}",
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
    try:
        return coerce(value, PARAMS[name].type, name)
    except LabkitError as e:
        raise LabkitError(f"parameter {e.what}", f"pass a value of type {PARAMS[name].type_name}") from None


def _caller_base() -> Path:
    """Where the user runs: papermill's kernel cwd, or the folder `labkit run` was called from."""
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


LAYOUT_PARAMS = ("dp", "mp", "pp", "micro_batch", "accum", "global_batch", "output_dir")  # set by the search


@dataclass(frozen=True)
class Settings:
    """Stage 1: the typed parameters and the run config they give (plain settings applied, layout not yet)."""

    given: dict  # parameter -> its typed value (None: not given)
    preset: str
    pre: dict  # PRESETS[preset]
    base: RunConfig  # the config file as written, with the preset's overrides
    data: dict  # `base` as a mapping with the plain parameters applied
    cfg: RunConfig  # `data`, loaded and validated
    model: object  # labkit.config.ModelConfig


def _settings(namespace: dict) -> Settings:
    given = {name: _typed(name, namespace.get(name, DEFAULTS[name])) for name in PARAMS}
    preset = given["preset"]
    if preset not in PRESETS:
        raise LabkitError(f"parameter preset = {preset!r} is not known", f"use one of {', '.join(PRESETS)}")
    pre = PRESETS[preset]
    base = load_run_config(given["config"] or pre["config"],
                           [] if given["config"] else [f"{k}={v}" for k, v in pre.get("overrides", {}).items()])
    data = to_dict(base)
    for p in PARAMETERS:  # plain settings: the parameter wins, None keeps the config's value
        if p.field and given[p.name] is not None and p.name not in LAYOUT_PARAMS:
            set_value(data, p.field, given[p.name])
    cfg = load(RunConfig, data)  # validates types, schedule, recompute syntax later
    model = cfg.model_config()
    if cfg.data.seq_len > model.max_position_embeddings:
        raise LabkitError(f"parameter seq_len = {cfg.data.seq_len} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}", f"use seq_len <= {model.max_position_embeddings}")
    return Settings(given=given, preset=preset, pre=pre, base=base, data=data, cfg=cfg, model=model)


@dataclass(frozen=True)
class Placement:
    """Stage 2: devices over nodes, the planner's device preset, memory per device, and whether this machine
    has the devices for its share."""

    devices: int
    nodes: int
    workers: int  # devices on this node
    device_name: str  # planner device preset
    memory_gib: float  # per device
    why_not: str | None  # why this machine does not train (None: it does)
    sources: dict  # parameter -> (value, where it came from), for values derived here


def _placement(s: Settings) -> Placement:
    given, target = s.given, s.cfg.parallel.device_target
    devices = given["devices"] or s.pre["devices"]
    if devices < 1:
        raise LabkitError(f"parameter devices = {devices} must be >= 1")
    same_target = target == s.base.parallel.device_target
    dev_name = given["device"] or (s.pre.get("device") if same_target else None) or DEVICE_FOR_TARGET[target]
    dev = device_preset(dev_name, measure=False)  # the CPU's GEMM peak is measured later, once validation passed
    nodes = given["nodes"] or (1 if target == "CPU" else max(1, math.ceil(devices / dev.devices_per_node)))
    if devices % nodes:
        raise LabkitError(f"devices {devices} do not split evenly over nodes {nodes}",
                          "choose nodes dividing devices (every node runs the same number of workers)")
    workers = devices // nodes
    if not 0 <= given["node_rank"] < nodes:
        raise LabkitError(f"parameter node_rank = {given['node_rank']} is outside 0..{nodes - 1}")
    why_not = shortfall(target, workers)
    if nodes > 1 and why_not is None and not (given["master_addr"] and given["master_port"]):
        raise LabkitError(f"nodes = {nodes} needs master_addr and master_port (node 0's host and a free port)",
                          "pass -p master_addr HOST -p master_port PORT, the same on every node")
    memory = given["device_memory_gib"] or (
        round(host_ram_gib() / workers, 1) if dev.name == "cpu" else dev.memory_gib)
    sources = {}
    if given["device_memory_gib"] is None:
        sources["device_memory_gib"] = (memory, "host RAM / workers" if dev.name == "cpu" else f"device {dev.name}")
    return Placement(devices=devices, nodes=nodes, workers=workers, device_name=dev_name, memory_gib=memory,
                     why_not=why_not, sources=sources)


@dataclass(frozen=True)
class Pinned:
    """Stage 3: what the parameters fix of the layout and the batch, checked against the devices and target."""

    dp: int | None  # None: searched
    mp: int | None
    pp: int | None
    optimizer_shard: bool  # asked for (and possible: more than one device)
    micro_batch: int | None  # None: derived
    accum: int | None
    global_batch: int | None  # the global batch every layout must keep; None: micro_batch x dp x accum
    sources: dict


def _check_layout(devices: int, target: str, dp: int | None, mp: int | None, pp: int | None, cp: int = 1) -> None:
    """dp x mp x pp x cp = devices for the pinned ones (cp: the config's parallel.cp), and what CPU cannot run."""
    if devices % cp:
        raise LabkitError(f"parallel.cp {cp} does not divide devices ({devices})", "choose a cp dividing devices")
    devices //= cp
    pinned = [(n, v) for n, v in (("dp", dp), ("mp", mp), ("pp", pp)) if v is not None]
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
    if target == "CPU" and ((mp or 1) > 1 or (pp or 1) > 1):
        raise LabkitError(f"mp {mp} / pp {pp} need semi_auto_parallel, which MindSpore 2.9 refuses on CPU",
                          "on CPU use data parallel only (mp 1, pp 1), or device_target Ascend/GPU")


def _pinned(s: Settings, place: Placement) -> Pinned:
    given, target, devices = s.given, s.cfg.parallel.device_target, place.devices
    _check_layout(devices, target, given["dp"], given["mp"], given["pp"], s.cfg.parallel.cp)
    shard, sources = s.cfg.parallel.optimizer_shard, {}
    if devices == 1 and shard:
        shard = False
        sources["optimizer_shard"] = (False, "one device: nothing to shard over")
    if target == "CPU" and shard:
        raise LabkitError("optimizer_shard needs MindSpore's parallel optimizer (semi_auto_parallel), which is "
                          "refused on CPU", "pass -p optimizer_shard False, or run on Ascend/GPU")
    mb, acc, g = given["micro_batch"], given["accum"], given["global_batch"]
    for name, v in (("micro_batch", mb), ("accum", acc), ("global_batch", g)):
        if v is not None and v < 1:
            raise LabkitError(f"parameter {name} = {v} must be >= 1")
    t, bp = s.cfg.train, s.base.parallel
    config_dp = bp.dp or max(1, s.pre["devices"] // (bp.mp * bp.pp * bp.cp))
    g_fixed = g or (None if mb and acc else t.global_batch or t.micro_batch * t.accum * config_dp)
    return Pinned(dp=given["dp"], mp=given["mp"], pp=given["pp"], optimizer_shard=shard, micro_batch=mb,
                  accum=acc, global_batch=g_fixed, sources=sources)


@dataclass(frozen=True)
class Search:
    """Stage 4: the planner's rows for every layout the parameters allow, best first (the best one fits)."""

    device: object  # labkit.parallel.devices.Device, with the CPU's GEMM peak measured
    rows: list

    @property
    def best(self):
        return self.rows[0]


def _layouts(s: Settings, place: Placement, pin: Pinned, dev, flash: bool) -> tuple[list, dict]:
    """The planner's row for each dp x mp x pp the parameters allow (x the config's cp), and why each other one
    cannot work."""
    t, devices, target, p = s.cfg.train, place.devices, s.cfg.parallel.device_target, s.cfg.parallel
    machine = Machine(devices, place.memory_gib, device=dev, nodes=place.nodes)
    rows, reasons = [], {}
    for m in divisors(devices // p.cp):
        for q in divisors(devices // p.cp // m):
            d = devices // p.cp // m // q
            if (pin.dp and d != pin.dp) or (pin.mp and m != pin.mp) or (pin.pp and q != pin.pp) or (
                    target == "CPU" and m * q > 1):
                continue
            mb, acc, g, why = split_batch(pin.global_batch, pin.micro_batch, pin.accum, t.micro_batch, d)
            if why is None:
                try:
                    layout = Layout(dp=d, mp=m, pp=q, cp=p.cp, cp_algo=p.cp_algo, ulysses_degree=p.ulysses_degree,
                                    micro_batch=mb, accum=acc, recompute=t.recompute,
                                    optimizer_shard=pin.optimizer_shard and d * p.cp > 1,
                                    optimizer=s.cfg.parallel.optimizer())
                    rows.append(estimate(s.model, machine, layout, seq_len=s.cfg.data.seq_len,
                                         amp_level=t.amp_level, flash_attention=flash))
                except LabkitError as e:
                    why = e.what
            if why:
                reasons[f"dp {d} x mp {m} x pp {q}"] = why
    return rows, reasons


def _search(s: Settings, place: Placement, pin: Pinned) -> Search:
    target = s.cfg.parallel.device_target
    flash = backend_flags(target).use_flash_attention
    dev = device_preset(place.device_name)
    rows, reasons = _layouts(s, place, pin, dev, flash)
    if not rows:
        raise LabkitError("no parallel layout passes the batch arithmetic: "
                          + "; ".join(f"{k}: {v}" for k, v in reasons.items()),
                          "micro_batch x dp x accum must equal global_batch: change micro_batch/accum/"
                          "global_batch, or leave micro_batch and accum None to derive them")
    rows.sort(key=lambda r: (not r.fits, -r.tokens_per_s, -r.dp))
    best, memory = rows[0], place.memory_gib
    if not best.fits:
        raise LabkitError(f"the planner says no layout fits in {memory:g} GiB per device (device_memory_gib): "
                          f"{best.why_not} "
                          f"(dp {best.dp} x mp {best.mp} x pp {best.pp}, micro_batch "
                          f"{best.micro_batch}, recompute {best.layout.recompute}, optimizer_shard "
                          f"{best.optimizer_shard})",
                          _memory_fix(s.model, Machine(place.devices, memory, device=dev, nodes=place.nodes), s.cfg,
                                      pin.global_batch or best.micro_batch * best.dp * best.accum, flash))
    return Search(device=dev, rows=rows)


def _chosen_sources(s: Settings, pin: Pinned, found: Search) -> dict:
    """Where the layout and batch values that were left None came from."""
    best, t, given = found.best, s.cfg.train, s.given
    fitting = sum(r.fits for r in found.rows)
    how = {"dp": f"planner's best of {fitting} fitting layouts", "mp": f"planner's best of {fitting} fitting layouts",
           "pp": f"planner's best of {fitting} fitting layouts",
           "micro_batch": "config" if best.micro_batch == t.micro_batch else
           f"config's {t.micro_batch}, lowered to divide global_batch / dp",
           "accum": "global_batch / (micro_batch x dp)",
           "global_batch": "config" if pin.global_batch else "micro_batch x dp x accum"}
    return {name: (getattr(best, name) if name in ("dp", "mp", "pp") else None, why)
            for name, why in how.items() if given[name] is None}


def _parallel_mode(devices: int, target: str, configured: str | None, best, shard: bool) -> str:
    if devices == 1:
        return "stand_alone"
    if target == "CPU":
        return "data_parallel"
    if configured in ("semi_auto_parallel", "auto_parallel"):
        return configured
    return "semi_auto_parallel" if (best.mp > 1 or best.pp > 1 or shard) else "data_parallel"


def _final_config(s: Settings, place: Placement, best, shard: bool, out: Path) -> RunConfig:
    """The run config with the chosen layout and batch, output_dir and the user paths made absolute."""
    data = copy.deepcopy(s.data)
    mode = _parallel_mode(place.devices, s.cfg.parallel.device_target, s.base.parallel.parallel_mode, best, shard)
    for key, value in (("parallel.dp", best.dp), ("parallel.mp", best.mp), ("parallel.pp", best.pp),
                       ("parallel.optimizer_shard", shard), ("parallel.parallel_mode", mode),
                       ("train.micro_batch", best.micro_batch), ("train.accum", best.accum),
                       ("train.global_batch", best.micro_batch * best.dp * best.accum)):
        set_value(data, key, value)
    data["output_dir"] = str(out)
    for key in ("dataset", "tokenizer", "init_checkpoint"):
        section = "train" if key == "init_checkpoint" else "data"
        if data[section].get(key):
            data[section][key] = str(_user_path(data[section][key]))
    return load(RunConfig, data)


def resolve(namespace: dict, *, check_files: bool = True) -> PretrainRun:
    """Validate the parameters (names from PARAMETERS, read from `namespace`, e.g. the notebook's globals()):
    settings, then placement, pinned layout and batch, the planner's search, and the final config."""
    s = _settings(namespace)
    prepare_process(s.cfg.parallel.device_target)  # before MindSpore is imported below (the CPU GEMM probe)
    place = _placement(s)
    pin = _pinned(s, place)
    found = _search(s, place, pin)
    given, best = s.given, found.best
    shard = pin.optimizer_shard and best.optimizer_shard
    scratch = given["output_dir"] is None
    out = (RUNS / "pretrain" / s.preset) if scratch else _caller_base() / Path(given["output_dir"]).expanduser()
    sources = {**{k: (v, "parameter") for k, v in given.items() if v is not None}, **place.sources, **pin.sources,
               **_chosen_sources(s, pin, found)}
    run = PretrainRun(preset=s.preset, cfg=_final_config(s, place, best, shard, out.resolve()), model=s.model,
                      device=found.device, device_memory_gib=place.memory_gib, devices=place.devices,
                      nodes=place.nodes, workers=place.workers, node_rank=given["node_rank"],
                      master_addr=given["master_addr"], master_port=given["master_port"], strategy=best,
                      alternatives=found.rows[1:], can_train=place.why_not is None, why_not=place.why_not,
                      output_dir=out.resolve(), resume=given["resume"], overwrite=given["overwrite"] or scratch,
                      resume_from=_resume_path(given, "resume_from"),
                      resume_strategy=_resume_path(given, "resume_strategy"), params=given, sources=sources)
    if check_files and run.can_train:
        _check_files(run, checkpoint)
    return run


def _resume_path(given: dict, name: str) -> Path | None:
    """resume_from / resume_strategy as an absolute path (None when not given); resume_strategy needs resume_from."""
    if given["resume_strategy"] is not None and given["resume_from"] is None:
        raise LabkitError("parameter resume_strategy is set without resume_from: a strategy describes the shards "
                          "of a checkpoint to continue from", "give -p resume_from (the earlier run's "
                          "output/checkpoint folder) too, or leave resume_strategy unset")
    return None if given[name] is None else _user_path(given[name])


def _check_resume_from(run: PretrainRun) -> None:
    """An earlier run's shards to continue from: a folder of rank_N folders (each with a .ckpt or .safetensors)
    or one complete checkpoint file, and its strategy folder or file when given."""
    src, strategy = run.resume_from, run.resume_strategy
    if src is None:
        return
    fix = "give the earlier run's output/checkpoint folder (one rank_N folder per card) or a complete .ckpt file"
    if not src.exists():
        raise LabkitError(f"parameter resume_from = {run.params['resume_from']} not found (looked at {src})", fix)
    if src.is_dir():
        ranks = [d for d in src.glob("rank_*") if d.is_dir()]
        empty = [d.name for d in ranks if not any(d.glob("*.ckpt")) and not any(d.glob("*.safetensors"))]
        if not ranks or empty:
            raise LabkitError(f"parameter resume_from = {src} holds "
                              + (f"no checkpoint in {', '.join(sorted(empty))}" if ranks else "no rank_N folder"),
                              fix)
    if strategy is not None and not strategy.exists():
        raise LabkitError(f"parameter resume_strategy = {run.params['resume_strategy']} not found (looked at "
                          f"{strategy})", "give the earlier run's output/strategy folder (ckpt_strategy_rank_N.ckpt "
                          "files) or one merged strategy file")


def host_ram_gib() -> float:
    import psutil


    return psutil.virtual_memory().total / GIB


def _check_files(run: PretrainRun, checkpoint) -> None:
    c = run.cfg
    _check_resume_from(run)
    for what, value, need in (("dataset", c.data.dataset, "a MindRecord folder from `labkit data build`"),
                              ("tokenizer", c.data.tokenizer, "a tokenizer folder with tokenizer.model"),
                              ("init_checkpoint", c.train.init_checkpoint, "a `labkit convert hf2ms` output")):
        if value and not Path(value).exists():
            raise LabkitError(f"parameter {what} = {run.params.get(what) or value} not found (looked at {value})",
                              f"give {need}; relative paths start where you run, configs/ and data/ at the lab root")
    # the pairs: a given dataset against seq_len and the vocabulary (a first-use build is checked when it is made),
    # init_checkpoint's weights against the model, a resumed checkpoint against the config, dataset and batch
    ds = run_dir.check_dataset(c) if c.data.dataset else None
    run_dir.check_init_checkpoint(c.train.init_checkpoint, c)
    run_dir.check_run_folder(run.output_dir, resume=run.resume, overwrite=run.overwrite, steps=c.train.steps,
                             spelling=run_dir.PAPERMILL, shared=run.nodes > 1,
                             fit=run_dir.ResumeFit(c, dataset=ds, global_batch=c.train.global_batch))


def _memory_fix(model, machine, cfg: RunConfig, global_batch: int, flash: bool) -> str:
    """The planner's fastest fitting strategy for the machine's devices, as parameters to pass."""
    target = cfg.parallel.device_target
    found = []
    for rc in ("none", "full"):
        cons = {"recompute": rc, **({"mp": 1, "pp": 1} if target == "CPU" else {})}
        if target == "CPU":
            cons["optimizer_shard"] = False
        res = planner.plan(model, machine, seq_len=cfg.data.seq_len, global_batch=global_batch,
                           numerics=Numerics(amp_level=cfg.train.amp_level, flash_attention=flash),
                           constraints=cons, optimizer=cfg.parallel.optimizer())
        found += [r for r in res["strategies"] if r.fits]
        why = res["why"]
    if not found:
        return f"the planner finds no fitting strategy at all: {why}"
    b = max(found, key=lambda r: r.tokens_per_s)
    rc = b.layout.recompute
    return (f"the planner's fastest fitting strategy for global_batch {global_batch}: -p dp {b.dp} -p mp "
            f"{b.mp} -p pp {b.pp} -p micro_batch {b.micro_batch} -p recompute {rc} -p optimizer_shard "
            f"{b.optimizer_shard} ({b.memory_gib['total']:.1f} GiB)")


# ---------------------------------------------------------------------------------------------- the 7B recipes


