"""The training loop: MindSpore primitives around `mindformers.LlamaForCausalLM`.

mindformers' `Trainer` does not run on CPU (its loss-scale wrapper calls an Ascend-only operator), so this loop is
written with `ms.value_and_grad`, `nn.AdamWeightDecay`, `ms.amp.DynamicLossScaler` and `ms.amp.all_finite` under
`@ms.jit`. The same code runs stand-alone, under msrun (data parallel) and on Ascend/GPU. With train.kernels custom
on CPU the optimizer is its C++ subclass (labkit.model.kernels.adamw): the same update, fewer passes.

Step t (0-based) consumes the global batch t of `labkit.data.loader.make_loader`; checkpoints store the step, so a resumed
run reads exactly the batches the uninterrupted run would have read.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from labkit.config import AMP_LEVELS, RunConfig, loss_scaled, dump_run_config, flag_values, load_run_config, to_dict
from labkit.data import dataset as data
from labkit.data import loader
from labkit.errors import LabkitError, LabkitFailure
from labkit.io import OutputLock, atomic_write_text
from labkit.logs import quiet_mindformers
from labkit.model.kernels.adamw import adamw_ops, optimizer_class
from labkit.model.llama import Backend, build_model
from labkit.model.shapes import flops_per_token
from labkit.output import add_common_flags, emit
from labkit.parallel.devices import cached_gemm_peak
from labkit.paths import lab_path
from labkit.training import checkpoint, run_dir
from labkit.training.evaluate import Evaluator
from labkit.training.fault import Fault, check_fault
from labkit.training.generate import Sampler, sample_texts
from labkit.training.metrics import (
    POOL_STATS_ENV,
    pool_peak_mb,
    read_metrics,
    rewrite_metrics,
    steady,
    steady_throughput,
)
from labkit.training.monitor import LeakMonitor
from labkit.training.oom import train_watched
from labkit.training.schedule import WarmupCosine, lr_at
from labkit.training.step import grad_ops, update_tail
from labkit.training.tensorboard import EventWriter
from labkit.training.world import barrier, check_batch, dp_size, init_context, mean_over_ranks, peak_memory_mb


class Trainer:
    """Builds everything once; `run()` trains from the current step to cfg.train.steps."""

    def __init__(self, cfg: RunConfig, resume: bool = False, log=None):
        self.cfg, t = cfg, cfg.train
        self.log = log or (lambda m: print(m, file=sys.stderr))
        self.out = Path(cfg.output_dir)
        self.model_cfg = mcfg = cfg.model_config()
        # the checks that need no framework come first: a refusal answers at once, not after seconds of imports
        if cfg.data.seq_len > mcfg.max_position_embeddings:
            raise LabkitError(f"data.seq_len {cfg.data.seq_len} exceeds model max_position_embeddings "
                              f"{mcfg.max_position_embeddings}", "shorten data.seq_len or raise the model's limit")
        if cfg.parallel.device_target == "CPU" and AMP_LEVELS[t.amp_level]["compute_dtype"] == "bfloat16":
            raise LabkitError(f"train.amp_level {t.amp_level} computes in bfloat16: MindSpore 2.9's CPU build has no "
                              "bfloat16 MatMul kernel", "use amp_level O0, O2 or fp16 on CPU; bf16 is for Ascend")
        run_dir.check_init_checkpoint(t.init_checkpoint, cfg)  # names, shapes, dtypes against the model config
        # resume: the checkpoint against the config (model, dtype, loss-scale state, data order); see run_dir
        folder = run_dir.check_run_folder(self.out, resume=True, overwrite=False, steps=t.steps,
                                          fit=run_dir.ResumeFit(cfg)) if resume else None
        quiet_mindformers()
        import mindspore as ms
        from mindspore import nn


        self.world = init_context(cfg)
        self.dp = dp_size(cfg, self.world)
        self.global_batch = check_batch(cfg, self.dp)
        checked = run_dir.check_dataset(cfg)
        if folder is not None:  # the dataset's tokenizer and the global batch against the checkpoint's
            run_dir.check_resume_data(folder, cfg, dataset=checked, global_batch=self.global_batch)
        self.dataset = checked.path
        self.amp = AMP_LEVELS[t.amp_level]
        backend = Backend(device_target=cfg.parallel.device_target, **self.amp, kernels=t.kernels)
        self.model = build_model(mcfg, seq_length=cfg.data.seq_len, batch_size=t.micro_batch, backend=backend,
                                 recompute_layers=t.recompute.layers(mcfg.num_layers), seed=t.seed,
                                 parallel_config=self._mf_parallel_config())
        if t.init_checkpoint:
            self._load_init(t.init_checkpoint)
        net = self.model
        if t.amp_level == "O1":
            try:
                net = ms.amp.auto_mixed_precision(self.model, "O1")
            except Exception as e:  # MindSpore's network rewrite cannot parse mindformers' Linear (2.9.0)
                # with kernels custom it stops earlier, at labkit's own cell classes (built inside functions)
                what = "mindformers' Llama" + (" with labkit's custom cells" if t.kernels == "custom" else "")
                raise LabkitFailure(
                    f"amp_level O1: ms.amp.auto_mixed_precision(model, 'O1') failed on {what}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                    "use amp_level O2 (float16 compute through mindformers' own dtype settings) or O0") from e
        net.set_train(True)
        params = self.model.trainable_params()
        decay = [p for p in params if len(p.shape) > 1]
        no_decay = [p for p in params if len(p.shape) <= 1]
        self.fused_opt = self._fused_optimizer(params)
        self.opt = (self.fused_opt or nn.AdamWeightDecay)(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            learning_rate=WarmupCosine(t), beta1=t.beta1, beta2=t.beta2, eps=t.eps)
        self.scaler = None
        if loss_scaled(t.amp_level):
            self.scaler = ms.amp.DynamicLossScaler(t.loss_scale, t.scale_factor, t.scale_window)
        self._compile(net)
        self.evaluator, self.sampler = self._evaluation(net, checked.stats)
        self.step, self.history, self.overflows = 0, [], 0
        if resume:
            self._resume()
        self.loader = loader.make_loader(self.dataset, t.micro_batch, seed=t.seed, dp_size=self.dp,
                                       dp_rank=self._dp_rank(), accum=t.accum, start_step=self.step, data=cfg.data)
        self.flops_per_token = flops_per_token(mcfg, cfg.data.seq_len)["model"]  # the planner's MFU count
        self.peak_flops = t.peak_tflops * 1e12 if t.peak_tflops else None

    # ------------------------------------------------------------------ setup pieces
    def _dp_rank(self) -> int:
        return self.world.rank % self.dp if self.world.mode != "stand_alone" else 0

    def _mf_parallel_config(self):
        if self.world.mode in ("stand_alone", "data_parallel"):
            return None
        p = self.cfg.parallel
        return dict(data_parallel=self.dp, model_parallel=p.mp, pipeline_stage=p.pp,
                    micro_batch_num=max(p.pp, self.cfg.train.accum), vocab_emb_dp=True)

    def _fused_optimizer(self, params):
        """The C++ AdamW class (labkit.model.kernels.adamw) when train.kernels is custom on CPU, without a sharded
        optimizer and with float32 weights; else None (MindSpore's nn.AdamWeightDecay)."""
        import mindspore as ms

        if (self.cfg.train.kernels != "custom" or self.cfg.parallel.device_target != "CPU"
                or self.world.mode not in ("stand_alone", "data_parallel")
                or any(p.dtype != ms.float32 for p in params)):
            return None

        return optimizer_class() if adamw_ops() is not None else None

    def _load_init(self, path):
        import mindspore as ms

        # names, shapes and dtypes were checked against the model config before it was built (check_init_checkpoint)
        not_loaded, _ = ms.load_param_into_net(self.model, checkpoint.load_weights(path), strict_load=True)
        if not_loaded:
            raise LabkitFailure(f"init_checkpoint {path} passed the shape check but left {not_loaded[:3]} of the "
                                "built model unloaded: labkit.weights.name_map and mindformers' model disagree",
                                "report this with the model config")

    def _compile(self, net):
        """One graph per micro-step. Gradients never leave the graph: passing a fresh gradient tuple from one
        @ms.jit graph into another cost seconds per step on CPU (measured), so accumulation uses Parameter
        buffers and the last micro-step unscales, checks, clips and updates in the same graph. Every
        per-gradient operation goes through `HyperMap` (see `grad_ops`)."""
        import mindspore as ms
        from mindspore import nn, ops
        from mindspore.ops import functional as F

        opt, clip, accum = self.opt, self.cfg.train.grad_clip, self.cfg.train.accum
        scaled = self.scaler is not None  # all_finite and the update branch only matter under loss scaling
        g_ops, hmap = grad_ops(), ops.HyperMap()
        tail = update_tail(opt, clip, scaled, fused=self.fused_opt is not None)
        reducer = None
        if self.world.mode == "data_parallel":
            reducer = nn.DistributedGradReducer(opt.parameters, mean=True, degree=self.world.size)
        acc, grad_fn = self._accumulators(), self._grad_fn(net)

        @ms.jit
        def accumulate(x, scale):
            (_, loss), grads = grad_fn(x, scale)
            return F.depend(loss, hmap(g_ops["assign_add"], acc, grads))

        @ms.jit
        def step(x, scale, denom):
            (_, loss), grads = grad_fn(x, scale)
            if accum > 1:
                grads = hmap(g_ops["add"], acc, grads)
            if reducer is not None:
                grads = reducer(grads)
            finite, norm = tail(grads, denom)
            if accum > 1:
                loss = F.depend(loss, hmap(g_ops["zero"], acc))
            return loss, finite, norm

        self._accumulate, self._step = accumulate, step

    def _evaluation(self, net, stats):
        """The validation-loss graph (train.eval_every > 0) and, on rank 0, the sampler for train.sample_prompts."""
        t = self.cfg.train
        if not t.eval_every:
            return None, None
        vdir = data.val_dir(self.dataset)
        if vdir is None:
            raise LabkitError(f"train.eval_every {t.eval_every} but dataset {self.dataset} has no validation set",
                              "set data.val_fraction (e.g. 0.02) for a first-use build, or build the dataset with "
                              "`labkit data build --val-fraction 0.02`; or set train.eval_every 0")
        evaluator = Evaluator(net, data.read_samples(vdir), t.micro_batch, self.dp, self._dp_rank(), self.world.size,
                              t.eval_samples)
        sampler = None
        if t.sample_prompts and self.world.rank == 0:
            sampler = (Sampler(self.model_cfg, self.cfg.data.seq_len),
                       data.load_fast_tokenizer(lab_path(stats["tokenizer"])))
        return evaluator, sampler

    def evaluate(self) -> dict:
        """val_loss and val_ppl of the current weights; on rank 0 also writes samples.jsonl."""
        rec = self.evaluator()
        if self.sampler is not None:
            t = self.cfg.train
            sampler, tok = self.sampler
            sampler.load(dict(self.model.parameters_and_names()))
            rows = sample_texts(sampler, tok, t.sample_prompts, t.sample_tokens, t.sample_temperature,
                                t.sample_top_k, t.seed)
            with open(self.out / "samples.jsonl", "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps({"step": self.step, **rec, **row}, ensure_ascii=False) + "\n")
        return rec

    def _accumulators(self):
        """float32 gradient buffers (`self.acc`) when accumulating, else None."""
        import mindspore as ms
        from mindspore import ops

        self.acc = None
        if self.cfg.train.accum > 1:
            self.acc = ms.ParameterTuple(
                ms.Parameter(ops.zeros(p.shape, ms.float32), name=f"accu_grads.{p.name}", requires_grad=False)
                for p in self.opt.parameters)
        return self.acc

    def _grad_fn(self, net):
        """(scaled loss, loss) and the gradients of the scaled loss with respect to the optimizer's parameters."""
        import mindspore as ms

        def loss_fn(x, scale):
            loss = net(x)
            return loss * scale, loss

        return ms.value_and_grad(loss_fn, None, self.opt.parameters, has_aux=True)

    def state_params(self):
        named = list(self.model.parameters_and_names()) + list(self.opt.parameters_and_names())
        if self.scaler is not None:
            named += [("loss_scale.value", self.scaler.scale_value), ("loss_scale.counter", self.scaler.counter)]
        return named

    def _resume(self):
        import mindspore as ms

        ck, params, meta = checkpoint.load_newest_good(self.out, self.log)  # skips damaged ones, saying so
        targets = dict(self.state_params())
        missing = sorted(set(targets) - set(params))
        if missing:
            raise LabkitError(f"checkpoint {ck} lacks {missing[:3]} ({len(missing)} in all)",
                              "resume with the same amp_level and model as the run that wrote it")
        for name, p in targets.items():
            p.set_data(ms.Tensor(params[name].asnumpy(), p.dtype))
        self.step = int(meta["step"])
        self.overflows = int(meta.get("overflows", 0))
        self.history = [m for m in read_metrics(self.out) if m["step"] <= self.step]
        self.log(f"resumed from {ck} at step {self.step}")

    # ------------------------------------------------------------------ the loop
    def run(self, on_step=None, fault: Fault | None = None) -> dict:
        """Train to cfg.train.steps. `fault` is a drill: its rank ends itself with SIGKILL right after that step."""
        t, rank0 = self.cfg.train, self.world.rank == 0
        if fault is not None:
            check_fault(fault.rank, fault.after_step, self.world.size, self.step, t.steps)
        if self.peak_flops is None and rank0:  # the MFU is rank 0's figure (metrics.jsonl): the others skip the probe
            self.peak_flops = cached_gemm_peak()
        lock = OutputLock(self.out, 0, "labkit train").acquire() if rank0 else None  # one writer per run folder
        if rank0:
            atomic_write_text(self.out / "config.yaml", dump_run_config(self.cfg))
            rewrite_metrics(self.out, self.history)
        bar = _progress(t.steps, self.step, rank0)
        tokens_per_step = self.global_batch * self.cfg.data.seq_len
        self.memory = LeakMonitor()  # rec["rss_mb"] each step; a steady RSS slope is reported at the end
        events = EventWriter(self.out) if rank0 else None  # TensorBoard files beside metrics.jsonl
        try:
            while self.step < t.steps:
                rec = self._train_step(tokens_per_step)
                self.memory(rec)
                if self.evaluator is not None and (self.step % t.eval_every == 0 or self.step == t.steps):
                    rec.update(self.evaluate())
                    self.memory.one_off(self.step)
                if rank0:
                    events.add(rec)
                    with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
                        f.write(json.dumps(rec) + "\n")
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", refresh=False)
                if on_step:
                    on_step(rec)
                if (t.save_every and self.step % t.save_every == 0) or self.step == t.steps:
                    self.save()
                    self.memory.one_off(self.step)
                if fault is not None and fault.hits(self.world.rank, self.step):
                    fault.die(self.log)
        finally:  # a stopped run (NaN, interrupt) must not leave a bar to be redrawn at exit
            bar.close()
            if events is not None:
                events.close()
            if lock is not None:
                lock.release()
        memory = self.memory.report()
        if memory["flagged"] and rank0:
            self.log(memory["message"])
        summary = self.summary()
        if rank0 and (summary["mfu"] or 0) > 1:
            self.log(f"warning: MFU {summary['mfu']:.0%} is impossible: the peak {self.peak_flops / 1e12:.3g} TFLOP/s "
                     f"is too low; set train.peak_tflops to the device's real peak")
        return summary

    def _train_step(self, tokens_per_step: int) -> dict:
        """One optimizer step (accum micro-steps), checked, counted and recorded in self.history."""
        import mindspore as ms

        t = self.cfg.train
        batches = [ms.Tensor(next(self.loader)) for _ in range(t.accum)]  # data loading stays outside the timer
        start = time.perf_counter()
        scale = float(self.scaler.scale_value.asnumpy()) if self.scaler else 1.0
        scale_t = ms.Tensor(scale, ms.float32)
        losses = [self._accumulate(x, scale_t) for x in batches[:-1]]
        loss, finite, norm = self._step(batches[-1], scale_t, ms.Tensor(scale * t.accum, ms.float32))
        losses.append(loss)
        finite = bool(finite.asnumpy())
        loss = float(sum(float(v.asnumpy()) for v in losses) / t.accum)
        if self.world.size > 1:
            loss = mean_over_ranks(loss)
        if self.scaler is not None:
            self.scaler.adjust(ms.Tensor(finite))
        grad_norm = float(norm.asnumpy())
        self._health(finite, loss, grad_norm, scale)
        self.step += 1
        seconds = time.perf_counter() - start
        rec = {"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, t), "grad_norm": grad_norm,
               "loss_scale": scale, "overflow": not finite, "overflows": self.overflows,
               "tokens_per_s": tokens_per_step / seconds, "step_time_s": seconds,
               "mfu": (self.flops_per_token * tokens_per_step / seconds / self.world.size / self.peak_flops
                       if self.peak_flops else None),
               "peak_mem_mb": peak_memory_mb(self.cfg.parallel.device_target)}
        self.history.append(rec)
        return rec

    def _health(self, finite: bool, loss: float, grad_norm: float, scale: float):
        t = self.cfg.train
        step = self.step + 1
        if not finite or not math.isfinite(loss):
            if self.scaler is not None and scale > 1.0:
                self.overflows += 1
                self.log(f"step {step}: gradient overflow at loss scale {scale:g}; update skipped, scale reduced")
                return
            raise LabkitFailure(
                f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; training stopped with no "
                f"checkpoint of this step",
                f"likely causes: learning rate too high (lr={t.lr:g}; try 3-10x lower or a longer warmup), "
                f"float16 overflow ({t.amp_level}: use loss scaling or O0), or bad data (check `labkit data build` "
                f"warnings). Resume from the last checkpoint with --resume after fixing it")
        if grad_norm > t.grad_norm_alert and self.world.rank == 0:
            self.log(f"step {step}: gradient norm {grad_norm:.2f} above alert threshold {t.grad_norm_alert:g} "
                     f"(data spike, lr too high or loss scale unstable?)")

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint; every rank waits at a barrier so none runs ahead of a half-written save."""
        path = None
        if self.world.rank == 0:
            t = self.cfg.train
            meta = {"samples_consumed": self.step * self.global_batch, "global_batch": self.global_batch,
                    "rng": {"seed": t.seed, "note": "data order and init are functions of seed and step"},
                    "overflows": self.overflows, "lr_schedule_step": self.step,
                    "config": json.loads(json.dumps(to_dict(self.cfg), default=str))}
            path = checkpoint.save(self.out, self.step, self.state_params(), meta, t.keep_checkpoints)
        if self.world.size > 1:
            barrier()
        return path

    def summary(self) -> dict:
        h = self.history
        val = [r for r in h if "val_loss" in r]
        return {"ok": True, "output": str(self.out), "steps": self.step,
                "val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
                "final_loss": h[-1]["loss"] if h else None, "first_loss": h[0]["loss"] if h else None,
                "tokens_per_s": steady_throughput(h)["tokens_per_s"],
                "mfu": steady(h, "mfu") if h and self.peak_flops else None,
                "peak_mem_mb": max((r["peak_mem_mb"] for r in h), default=None), "overflows": self.overflows,
                "checkpoint": str(checkpoint.latest(self.out)) if checkpoint.latest(self.out) else None,
                "world_size": self.world.size, "global_batch": self.global_batch}


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled, file=sys.stderr)


def train(cfg: RunConfig, resume: bool = False, on_step=None, log=None, fault: Fault | None = None) -> dict:
    return Trainer(cfg, resume=resume, log=log).run(on_step=on_step, fault=fault)


# ---------------------------------------------------------------------------------------------- CLI


def add_train_flags(parser) -> None:
    """The flags `labkit train` and `labkit launch` share."""
    parser.add_argument("--config", help="run config YAML (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.lr=1e-3 (repeatable)")
    parser.add_argument("--steps", type=int, help="stop after this step, counted from the start of training")
    parser.add_argument("--micro-batch", type=int, help="samples per worker per micro-step")
    parser.add_argument("--accum", type=int, help="gradient-accumulation micro-steps")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--output", help="run folder (checkpoints, metrics.jsonl)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest full checkpoint in --output")
    parser.add_argument("--kill-rank", type=int, help="fault drill: this rank ends itself with SIGKILL ...")
    parser.add_argument("--kill-after-step", type=int, default=1, help="... right after this step (default 1)")


def config_from_args(args) -> RunConfig:
    return load_run_config(args.config or "configs/tiny_cpu.yaml", args.set, flag_values(args))


def device_target_of(args) -> str:
    """The device target of a `labkit train` command line, for `prepare_process` before anything imports MindSpore:
    its run config's. A config that does not load gives CPU here; the command then reports it with its fix."""
    try:
        return config_from_args(args).parallel.device_target
    except LabkitError:
        return "CPU"


def add_cli(parser) -> None:
    add_train_flags(parser)
    add_common_flags(parser, "print one JSON object (the run summary)")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    cfg = config_from_args(args)
    watcher_code = train_watched(cfg, args)  # typed on a command line: a parent process names an OOM kill
    if watcher_code is not None:
        return watcher_code
    fault = Fault(args.kill_rank, args.kill_after_step) if args.kill_rank is not None else None
    summary = train(cfg, resume=args.resume, fault=fault)
    if int(os.environ.get("RANK_ID", os.environ.get("MS_NODE_ID", "0")) or 0) == 0:
        text = (f"trained to step {summary['steps']}: loss {summary['first_loss']:.4f} → {summary['final_loss']:.4f}, "
                f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%}\n"
                f"metrics: {cfg.output_dir}/metrics.jsonl\ncheckpoint: {summary['checkpoint']}")
        emit(args, summary, text)
    return 0


def train_in_subprocess(config: str = "configs/tiny_cpu.yaml", sets: list[str] | tuple = (),
                        timeout: float = 1800) -> dict:
    """Run `labkit train --json` in a fresh process and return its summary plus `pool_peak_mb`, MindSpore's
    memory-pool peak (a step's live tensors). Memory comparisons need one process per configuration."""
    import subprocess

    cmd = [sys.executable, "-m", "labkit", "train", "--config", str(config), "--json"]
    for s in sets:
        cmd += ["--set", s]

    env = {**os.environ, "GLOG_v": "3", **POOL_STATS_ENV}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"ok": False, "error": p.stderr[-2000:]}
    result["pool_peak_mb"] = pool_peak_mb(p.stdout + p.stderr)
    if p.returncode or not result.get("ok", False):
        raise LabkitFailure(f"labkit train {' '.join(sets)} failed: {result.get('error')}",
                            "run the same command in a terminal to see the whole log")
    return result
