"""After (or instead of) the run: final figures and how to resume, the model's shapes proven without weights, and
the two Llama-2-7B recipes compared by the planner."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from labkit.config import load_run_config
from labkit.course import nb
from labkit.course.pretrain.follow import figure_png
from labkit.course.pretrain.outputs import NODE0_ONLY, commands, mindformers_yaml, write_configs
from labkit.course.pretrain.params import SEED_AS_WRITTEN
from labkit.course.pretrain.planner_view import estimate
from labkit.course.pretrain.runspec import PretrainRun
from labkit.errors import LabkitError
from labkit.logs import quiet_mindformers
from labkit.model.llama import backend_flags, count_parameters
from labkit.model.shapes import expected_hf_shapes, num_params
from labkit.parallel.cp_terms import mask_bytes
from labkit.parallel.devices import GIB, device_preset
from labkit.parallel import mindformers_yaml as mf_yaml
from labkit.parallel.memory import Numerics
from labkit.parallel.planner import Machine, cp_text, plan
from labkit.training import checkpoint
from labkit.training.metrics import health, read_metrics, steady
from labkit.weights.name_map import hf_to_ms


def expected_shapes(model) -> dict[str, tuple]:
    """mindformers parameter names and shapes the model config implies: HF's canonical shapes renamed by the
    conversion mapping (labkit.weights.convert), an independent derivation of what mindformers builds."""
    return {hf_to_ms(k): v for k, v in expected_hf_shapes(model).items()}


def prove_shapes(run: PretrainRun) -> dict:
    """Build the model from the written mindformers.yaml without allocating weights (mindformers' own
    MindFormerConfig + LlamaConfig + LlamaForCausalLM) and compare every name and shape with expected_shapes."""
    import time


    quiet_mindformers()
    import mindspore as ms
    from mindformers import LlamaConfig, LlamaForCausalLM
    from mindformers.tools.register import MindFormerConfig

    path = run.output_dir / "mindformers.yaml"
    if not path.exists():
        write_configs(run)
    if path.exists():
        mc = dict(MindFormerConfig(str(path)).model.model_config)
    else:  # another node than node 0 writes no run-level files: the same text, from a scratch file
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp) / "mindformers.yaml"
            scratch.write_text(mindformers_yaml(run), encoding="utf-8")
            mc = dict(MindFormerConfig(str(scratch)).model.model_config)
    mc.pop("type")
    start = time.perf_counter()
    with ms.nn.utils.no_init_parameters():
        model = LlamaForCausalLM(config=LlamaConfig(**mc))
    built = {n: tuple(p.shape) for n, p in model.parameters_and_names()}
    want = expected_shapes(run.model)
    wrong = {n: (built.get(n), s) for n, s in want.items() if built.get(n) != s}
    return {"parameters": count_parameters(model), "expected": num_params(run.model), "tensors": len(built),
            "mismatched": wrong, "unexpected": sorted(set(built) - set(want)),
            "seconds": round(time.perf_counter() - start, 2),
            "from": str(path) if path.exists() else "mindformers_yaml(run), not written on this node"}


def checkpoint_shapes(run: PretrainRun) -> dict:
    """The trained run's newest checkpoint against expected_shapes: what the workers really built and saved."""
    ck = checkpoint.latest(run.output_dir)
    if ck is None:
        raise LabkitError(f"no checkpoint in {run.output_dir}", "train first (the launch cell)")
    saved = {n: tuple(w.shape) for n, w in checkpoint.load_weights(ck).items()}
    want = expected_shapes(run.model)
    wrong = {n: (saved.get(n), s) for n, s in want.items() if saved.get(n) != s}
    return {"checkpoint": str(ck), "parameters": sum(math.prod(saved[n]) for n in want if n in saved),
            "expected": num_params(run.model), "tensors": len(want), "mismatched": wrong}


def summarize(run: PretrainRun, result=None) -> dict:
    """What the run did: final metrics, the static figure, checkpoints and how to resume; or, when nothing was
    trained here, the predicted figures and the commands. Key figures are recorded for `labkit run`."""
    cmds = commands(run)
    s = run.strategy
    out = {"trained": result is not None, "preset": run.preset, "devices": run.devices,
           "predicted_tokens_per_s_per_device": round(s.tokens_per_s_per_device, 1),
           "predicted_mfu": round(s.mfu, 3), "memory_gib_per_device": s.memory_gib["total"],
           "files": sorted(p.name for p in run.output_dir.glob("*") if p.is_file()), "commands": cmds}
    if result is not None and run.node_rank > 0:
        return _node_summary(run, result, out)
    if result is None:
        tokens = run.global_batch * run.cfg.data.seq_len * run.cfg.train.steps
        out.update(trained_here=False, why_not=run.why_not,
                   predicted_days=round(run.cfg.train.steps * s.step_time_s / 86400, 1), tokens=tokens)
        print(f"NOT TRAINED on this machine: {run.why_not}.\nWhat was done: the plan was validated "
              f"({s.memory_gib['total']:.1f} of {run.device_memory_gib:g} GiB per device), the configs were "
              f"written to {run.output_dir}" + (" (by node 0)" if run.node_rank else "") + ", the model was built "
              "without weights to check its shapes.\n"
              f"Predicted on {run.devices} x {run.device.name}: {s.step_time_s:.2f} s/step, "
              f"{s.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {s.mfu:.0%}; {run.cfg.train.steps:,} "
              f"steps ({tokens / 1e9:,.1f}B tokens) in about {out['predicted_days']} days.\n"
              f"To train, on each node ({run.nodes}):\n  " + "\n  ".join(cmds["labkit_launch"]))
        nb.record("07 trained", False)
        nb.record("07 predicted MFU", f"{s.mfu:.0%}")
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


def _node_summary(run: PretrainRun, result, out: dict) -> dict:
    """summarize() on a node other than node 0: what this node's workers did; the run's figures are node 0's."""
    first = run.node_rank * run.workers
    ranks = f"rank {first}" if run.workers == 1 else f"ranks {first}..{first + run.workers - 1}"
    out.update(trained_here=True, node_rank=run.node_rank, logs=result.logs, seconds=round(result.seconds, 1))
    print(f"node {run.node_rank} of {run.nodes}: its {run.workers} worker(s) ({ranks}) ended with exit 0 after "
          f"{out['seconds']} s; logs: {result.logs}\nnot summarised here: " + NODE0_ONLY["summary"])
    return out


def recipe_row(name: str, config: str, overrides: dict | None = None, *, devices: int = 8,
               device: str = "atlas_800t_a2", memory_gib: float | None = None, tokens: float = 100e9) -> dict:
    """One shipped recipe judged by the planner on `devices` x `device`, as the config says (no search)."""
    cfg = load_run_config(config, values=overrides)
    model, t, p = cfg.model_config(), cfg.train, cfg.parallel
    dev = device_preset(device)
    memory = memory_gib or dev.memory_gib
    dp = p.dp or devices // (p.mp * p.pp * p.cp)
    machine = Machine(devices, memory, device=dev, nodes=max(1, devices // dev.devices_per_node))
    layout = dataclasses.replace(cfg.layout(), dp=dp)
    flash = backend_flags(p.device_target if device != "cpu" else "CPU").use_flash_attention
    row = estimate(model, machine, layout, seq_len=cfg.data.seq_len, amp_level=t.amp_level, flash_attention=flash)
    m = row.memory_gib
    tokens_per_step = t.micro_batch * dp * t.accum * cfg.data.seq_len
    return {"recipe": name, "device": f"{devices} x {dev.name} ({memory:g} GiB)",
            "global batch": f"{t.micro_batch} x {dp} x {t.accum} = {t.micro_batch * dp * t.accum}",
            "tokens/step": tokens_per_step, "amp": t.amp_level, "recompute": str(t.recompute),
            "optimizer_shard": p.optimizer_shard and f"on, {p.optimizer_level}",
            "lr": f"{t.lr:g} -> {t.min_lr:g}, warmup {t.warmup_steps}",
            "model states GiB": round(m["weights"] + m["gradients"] + m["optimizer"], 1),
            "weight copies GiB": round(m["copies"], 1), "activations GiB": round(m["activations"], 1),
            "total GiB": round(m["total"], 1), "fits": row.fits,
            "step s": round(row.step_time_s, 2), "tokens/s/device": round(row.tokens_per_s_per_device),
            "MFU": round(row.mfu, 3),
            f"days for {tokens / 1e9:g}B tokens": round(tokens / row.tokens_per_s / 86400, 1)}


def compare_recipes(tokens: float = 100e9) -> list[dict]:
    """On the lab's 7B hardware (8 x Atlas 800T A2, 64 GiB): mindformers' recipe (fp16, the baseline), its bf16
    twin, the same with the lab's old O2 (float32 weights: what that costs) and the fix that makes O2 fit; the seeds'
    recipe as written, the changes tried, as shipped; the seeds' on their own 8 x A100 80 GB (no flash attention)."""
    mf, seed = "configs/llama2_7b_mindformers.yaml", "configs/llama2_7b_seed.yaml"
    mb4, gpu = {"train.micro_batch": 4, "train.accum": 16}, {"parallel.device_target": "GPU"}
    return [recipe_row("mindformers (fp16)", mf, tokens=tokens),
            recipe_row("mindformers bf16", mf, {"train.amp_level": "bf16"}, tokens=tokens),
            recipe_row("mindformers + O2", mf, {"train.amp_level": "O2"}, tokens=tokens),
            recipe_row("mindformers + O2 + level2", mf, {"train.amp_level": "O2", "parallel.optimizer_level": "level2"},
                       tokens=tokens),
            recipe_row("seed as written", seed, SEED_AS_WRITTEN, tokens=tokens),
            recipe_row("seed + optimizer_shard", seed, {**mb4, "parallel.optimizer_level": "level1"}, tokens=tokens),
            recipe_row("seed + optimizer_shard level2 + recompute all", seed, {**mb4, "train.recompute": "all"},
                       tokens=tokens),
            recipe_row("seed as shipped", seed, tokens=tokens),
            recipe_row("seed as written", seed, {**SEED_AS_WRITTEN, **gpu}, tokens=tokens, device="a100_80g"),
            recipe_row("seed as shipped", seed, gpu, tokens=tokens, device="a100_80g")]


# What only the cluster can settle about the 7B plan: each line the planner counts from MindSpore's source or
# documentation rather than from an object built here, the switch that measures it, and the figure to compare.
# mindformers' profiler keys (its run YAML): profile: True, profile_memory: True, profile_start_step,
# profile_stop_step, profiler_level; it calls mindspore.profiler with profile_memory and writes memory_record.csv and
# operator_memory.csv under output_dir/profile/rank_N/.../ASCEND_PROFILER_OUTPUT/.
CLUSTER_CHECKS = [
    ("the gathered weights live from forward to backward at level1/level2 (MindSpore's level3 docstring implies it)",
     "profile_memory: True; operator_memory.csv, the AllGather outputs' lifetimes", "copies"),
    ("the all-gather runs in the compute dtype (step_parallel_utils.cc FindChildCastWithFP32ToFP16, pp > 1 or "
     "accumulation)", "operator_memory.csv: the AllGather outputs' dtype and size", "copies"),
    ("the weight all-gather repeats every micro-step (MicroStepAllGather) or once a step",
     "profile: True; the AllGather count per step in the timeline", "step time"),
    ("accu_grads are whole at level1, 1/dp at level2/level3 (parameter_manager.cc SetClonedTensorShapeForOptimizer)",
     "memory_record.csv: the static memory after compilation", "gradients"),
    ("no gradient buffer beside accu_grads (each micro-step adds into it)", "memory_record.csv: the peak", "total"),
    ("the activations the planner counts (calibrated on CPU, Korthikanti's tensors on Ascend)",
     "mindspore.runtime.max_memory_allocated() after step 2", "activations"),
]


# The throughput mindformers publishes for Llama-2-7B on Atlas 800T A2 (docs/model_cards/llama2.md per release).
THROUGHPUT_ANCHORS = [
    {"tokens/s/card": 4820, "task": "pretraining (wiki, seq 4096)", "dtype": "float16",
     "yaml": "configs/llama2/pretrain_llama2_7b.yaml", "releases": "r1.1, r1.2",
     "use": "calibrates the planner's efficiency: the one pretraining figure, with the recipe the lab writes"},
    {"tokens/s/card": 4160, "task": "fine-tuning (alpaca, seq 4096), labelled Finetune", "dtype": "bfloat16",
     "yaml": "configs/llama2/pretrain_llama2_7b_bf16.yaml", "releases": "r1.3-r1.5",
     "use": "not a pretraining figure: shown, not used"},
]


def cluster_checks(strategy) -> list[dict]:
    """CLUSTER_CHECKS with the planner's figure (GiB per device, or s per step) each compares against."""
    m = strategy.memory_gib
    return [{"to check": what, "how": how,
             "planner says": f"{strategy.step_time_s:.2f} s/step" if part == "step time" else f"{m[part]:.1f} GiB"}
            for what, how, part in CLUSTER_CHECKS]


# ---------------------------------------------------------------------------------- Llama-2-7B at 32k tokens

LONG_CONTEXT = {"none": "no context parallelism", "colossalai_cp": "ring (colossalai_cp)",
                "ulysses_cp": "Ulysses (ulysses_cp)"}


def long_context_rows(seq_len: int = 32768, devices=(8, 16), *, global_batch: int = 8,
                      config: str = "configs/llama2_7b_mindformers.yaml", device: str = "atlas_800t_a2") -> list[dict]:
    """Llama-2-7B at `seq_len` tokens on 8 and 16 cards of `device` (mindformers' recipe's amp level, flash
    attention): per card count, the planner's best layout without context parallelism, with the ring and with
    Ulysses (best over cp 2, 4, 8 and everything else), whether it fits, GiB per card, the layout, throughput, the
    context-parallel keys the mindformers run YAML gets, and that whole YAML (`run_yaml`, written by
    mindformers_yaml.run_yaml after its mindformers checks). `global_batch` sequences per step: 8 x 32768 is the
    recipe's 64 x 4096 tokens per step."""
    base = load_run_config(config)
    model, amp = base.model_config(), base.train.amp_level
    dev = device_preset(device)
    rows = []
    for n in devices:
        machine = Machine(n, dev.memory_gib, device=dev, nodes=max(1, n // dev.devices_per_node))
        for kind, label in LONG_CONTEXT.items():
            pins = {"cp": 1} if kind == "none" else {"cp_algo": kind}
            res = plan(model, machine, seq_len=seq_len, global_batch=global_batch, constraints=pins,
                       numerics=Numerics(amp_level=amp, flash_attention=True), optimizer=base.parallel.optimizer())
            ranked = [r for r in res["strategies"] if (r.cp == 1) == (kind == "none")]
            best = next((r for r in ranked if r.fits), None) or min(ranked, key=lambda r: r.memory_gib["total"])
            rows.append(_long_context_row(base, best, n, label, seq_len))
    return rows


def _long_context_row(base, best, devices: int, label: str, seq_len: int) -> dict:
    lay = best.layout
    values = {"data.seq_len": seq_len, "parallel.dp": lay.dp, "parallel.mp": lay.mp, "parallel.pp": lay.pp,
              "parallel.cp": lay.cp, "parallel.cp_algo": lay.cp_algo, "parallel.ulysses_degree": lay.ulysses_degree,
              "parallel.optimizer_shard": lay.optimizer_shard, "train.micro_batch": lay.micro_batch,
              "train.accum": lay.accum, "train.global_batch": lay.global_batch, "train.recompute": str(lay.recompute)}
    cfg = load_run_config(base, values=values)
    doc = mf_yaml.run_yaml(cfg, lay, devices=devices)
    pc, mc = doc["parallel_config"], doc["model"]["model_config"]
    keys = {k: pc[k] for k in ("context_parallel", "context_parallel_algo", "ulysses_degree_in_cp") if k in pc}
    keys.update({k: mc[k] for k in ("use_flash_attention", "use_ring_attention", "use_attn_mask_compression")
                 if k in mc})
    act = Numerics(amp_level=cfg.train.amp_level).act_bytes
    mask = {c: mask_bytes(seq_len, lay.micro_batch, act, ring=lay.ring > 1, compressed=c) for c in (False, True)}
    m = best.memory_gib
    return {"cards": devices, "attention": label, "fits": best.fits, "GiB per card": round(m["total"], 1),
            "activations GiB": round(m["activations"], 1),
            "layout": f"dp {lay.dp} x mp {lay.mp} x pp {lay.pp} x cp {cp_text(lay)}",
            "batch": f"{lay.micro_batch} x {lay.dp} x {lay.accum}", "recompute": best.recompute,
            "optimizer_shard": lay.optimizer_shard, "tokens/s/card": round(best.tokens_per_s_per_device),
            "cp comm s/step": round(best.time_s["cp_comm"], 2),
            "mask GiB, full": round((mask[False]["constant"] + mask[False]["stored"]) / GIB, 3),
            "mask GiB, compressed": round((mask[True]["constant"] + mask[True]["stored"]) / GIB, 3),
            "yaml keys": keys, "run_yaml": doc}

