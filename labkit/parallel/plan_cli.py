"""`labkit plan`: the planner (labkit.parallel.planner) from the command line, for a model preset or a labkit run
config, with the best strategy's mindformers YAML and msrun command."""
from __future__ import annotations

import argparse

from labkit.config import AMP_LEVELS, ModelConfig, model_from_section, model_preset, read_yaml
from labkit.errors import LabkitError
from labkit.layout import CP_ALGOS, OPTIMIZER_LEVELS, OptimizerParallel
from labkit.output import add_common_flags, emit
from labkit.parallel.memory import Numerics
from labkit.parallel.mindformers_yaml import mindformers_parallel_yaml
from labkit.parallel.msrun import msrun_command
from labkit.parallel.planner import DEFAULT_EFFICIENCY, DEFAULT_GLOBAL_BATCH, Machine, format_table, plan


def model_from_config_file(path) -> tuple[ModelConfig, dict]:
    """The model of a labkit run config (its `model:` section: `preset: NAME` plus overrides, or ModelConfig
    fields) and the few other values the planner can use (data.seq_len, train.amp_level, parallel.optimizer_level,
    and parallel.cp, cp_algo, ulysses_degree when the file sets cp: they pin the search's context parallelism)."""
    data = read_yaml(path)
    section = data.get("model")
    if not isinstance(section, dict):
        raise LabkitError(f"{path} has no 'model:' section", "add model: {preset: tiny} or the ModelConfig fields")
    try:
        cfg = model_from_section(section)
    except LabkitError as e:
        raise LabkitError(f"{path}: {e.what}", e.fix) from None
    extra = {}
    seq = (data.get("data") or {}).get("seq_len") if isinstance(data.get("data"), dict) else None
    if seq:
        extra["seq_len"] = int(seq)
    train, par = data.get("train"), data.get("parallel")
    if isinstance(train, dict) and train.get("amp_level") in AMP_LEVELS:
        extra["amp_level"] = train["amp_level"]
    if isinstance(par, dict) and par.get("optimizer_level"):
        extra["optimizer_level"] = par["optimizer_level"]
    if isinstance(par, dict) and par.get("cp") is not None:
        extra["cp"] = {k: par[k] for k in ("cp", "cp_algo", "ulysses_degree") if par.get(k) is not None}
    return cfg, extra


def add_cli(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model preset (tiny, llama_100m, llama2_7b)")
    src.add_argument("--config", help="a labkit run config YAML with a model: section")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (cards)")
    parser.add_argument("--device-memory", type=float, required=True, help="memory per device, GiB")
    parser.add_argument("--device", default="atlas_800t_a2", help="device preset for peak FLOP/s and bandwidth "
                        "(atlas_800t_a2, a100_80g, h100_80g, h200_141g, cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096, or the "
                        "config's data.seq_len)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--amp-level", default=None, choices=list(AMP_LEVELS),
                        help="mixed precision, the dtypes of labkit.config.AMP_LEVELS (default: the config's, else "
                             "fp16, mindformers' recipe; O0 with --device cpu)")
    parser.add_argument("--optimizer-level", default=None, choices=OPTIMIZER_LEVELS,
                        help="MindSpore's parallel_optimizer_config.optimizer_level for strategies that shard "
                             "(default level1, or the config's)")
    parser.add_argument("--nodes", type=int, default=None, help="servers (default: from the preset's devices per node)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the preset's peak (TFLOP/s)")
    parser.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, help="achievable fraction of peak")
    parser.add_argument("--no-flash-attention", action="store_true", help="model attention without flash attention")
    parser.add_argument("--cp", type=_cp, default=None, help="context parallel degree (devices per sequence), or "
                        "'search' (1, 2, 4, 8); default: the config's parallel.cp, else 1 (searched when --cp-algo "
                        "is given)")
    parser.add_argument("--cp-algo", default=None, choices=CP_ALGOS,
                        help="mindformers' context_parallel_algo (default: colossalai_cp and ulysses_cp searched)")
    parser.add_argument("--ulysses-degree", type=int, default=None,
                        help="hybrid_cp: the Ulysses part of cp (ulysses_degree_in_cp)")
    parser.add_argument("--top", type=int, default=15, help="rows of the table (human output)")
    add_common_flags(parser, "print one JSON object")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    if args.preset:
        cfg, extra = model_preset(args.preset), {}
    else:
        cfg, extra = model_from_config_file(args.config)
    seq = args.seq_len or extra.get("seq_len") or 4096
    amp = args.amp_level or extra.get("amp_level") or ("O0" if args.device == "cpu" else "fp16")
    machine = Machine(args.devices, args.device_memory, device=args.device, nodes=args.nodes,
                      peak_tflops=args.peak_tflops, efficiency=args.efficiency)
    pins = {**extra.get("cp", {}), **{k: v for k, v in (("cp", args.cp), ("cp_algo", args.cp_algo),
                                                        ("ulysses_degree", args.ulysses_degree)) if v is not None}}
    result = plan(cfg, machine, seq_len=seq, global_batch=args.global_batch, constraints=pins,
                  numerics=Numerics(amp_level=amp,
                                    flash_attention=not args.no_flash_attention and args.device != "cpu"),
                  optimizer=OptimizerParallel(level=args.optimizer_level or extra.get("optimizer_level", "level1")))
    best = result["best"]
    if best:
        result["mindformers_yaml"] = mindformers_parallel_yaml(best.layout)
        result["msrun"] = msrun_command(best.layout, result["nodes"])
    text = [f"{cfg.name}: {result['params']:,} parameters; {args.devices} x {args.device_memory:g} GiB "
            f"({result['device']}, peak {result['peak_tflops']:g} TFLOP/s {result['precision']}, amp_level {amp}, "
            f"efficiency {args.efficiency:g}); seq {seq}, global batch {result['global_batch']}",
            f"bytes per parameter: {result['assumptions']['bytes_per_param']}",
            "", format_table(result, args.top), ""]
    if best:
        text += ["best:", result["mindformers_yaml"], result["msrun"]]
    else:
        text.append(f"no strategy fits: {result['why']}")
    as_json = {**result, "strategies": [r.to_dict() for r in result["strategies"]],
               "best": best.to_dict() if best else None}
    emit(args, {"ok": True, **as_json}, "\n".join(text))
    return 0


def _cp(text: str) -> int | str:
    """--cp: a degree, or "search"."""
    if text == "search":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is neither a degree nor 'search'") from None
