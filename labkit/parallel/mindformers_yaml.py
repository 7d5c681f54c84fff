"""A mindformers run YAML for a labkit run and the layout the planner chose, with the key names mindformers 1.9.0
reads: the parallel part alone (parallel, parallel_config, recompute_config) or the whole run; built as a mapping,
written with yaml.safe_dump."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from labkit.config import AMP_LEVELS, ModelConfig, RunConfig, loss_scaled
from labkit.errors import LabkitError
from labkit.layout import Layout, OptimizerParallel, Recompute
from labkit.model.llama import Backend, llama_config_kwargs
from labkit.parallel.cp_terms import check_mindformers, mask_compression


PARALLEL_MODES = {"data_parallel": 0, "semi_auto_parallel": 1, "auto_parallel": 2}
SEARCH_MODES = ("sharding_propagation", "recursive_programming")


def mindformers_parallel_config(layout: Layout, *, parallel_mode: str = "semi_auto_parallel",
                                search_mode: str = "sharding_propagation", num_layers: int | None = None) -> dict:
    """The `parallel`, `parallel_config`, `recompute_config` and `runner_config` blocks of a mindformers run YAML
    for a layout (keys as in mindformers r1.5.0 configs/llama2/pretrain_llama2_7b.yaml). `num_layers` is needed
    only when the layout recomputes some layers (`last:K`...): mindformers counts them per pipeline stage.
    With context parallelism (layout.cp > 1) also a `model.model_config` block with the model's keys it needs
    (context_model_keys); run_yaml merges it into the model's."""
    layout.check_context("layout")
    if parallel_mode not in PARALLEL_MODES:
        raise LabkitError(f"parallel_mode '{parallel_mode}' is not known", f"use {', '.join(PARALLEL_MODES)}")
    if search_mode not in SEARCH_MODES:
        raise LabkitError(f"search_mode '{search_mode}' is not known", f"use {' or '.join(SEARCH_MODES)}")
    s = layout.row()
    pipeline = s["pp"] > 1
    rc = layout.recompute.mindformers(num_layers, s["pp"])
    opt = layout.optimizer
    return {
        "use_parallel": True,
        "parallel": {"parallel_mode": PARALLEL_MODES[parallel_mode], "gradients_mean": False,
                     "enable_alltoall": False, "full_batch": True, "search_mode": search_mode,
                     "enable_parallel_optimizer": bool(s["optimizer_shard"]),
                     "strategy_ckpt_save_file": "./ckpt_strategy.ckpt",
                     # gradient_accumulation_shard only when set: MindSpore 2.9 refuses the key, even False, beside
                     # an optimizer_level other than level2 (parallel/_auto_parallel_context.py,
                     # set_parallel_optimizer_config)
                     "parallel_optimizer_config": {"optimizer_level": opt.level,
                                                   **({"gradient_accumulation_shard": True}
                                                      if opt.gradient_accumulation_shard else {}),
                                                   "parallel_optimizer_threshold": opt.threshold_kb,
                                                   "optimizer_weight_shard_size": opt.weight_shard_size}},
        "parallel_config": {"data_parallel": s["dp"], "model_parallel": s["mp"], "pipeline_stage": s["pp"],
                            **context_parallel_keys(layout), "use_seq_parallel": bool(layout.sequence_parallel),
                            "micro_batch_num": s["accum"] if pipeline else 1,
                            "vocab_emb_dp": True, "gradient_aggregation_group": 4},
        "micro_batch_interleave_num": 1,
        "recompute_config": {**rc, "parallel_optimizer_comm_recompute": opt.comm_recompute,
                             "mp_comm_recompute": True, "recompute_slice_activation": True},
        "runner_config": {"batch_size": s["micro_batch"], "gradient_accumulation_steps": 1 if pipeline else s["accum"]},
        **({"model": {"model_config": context_model_keys(layout)}} if layout.cp > 1 else {}),
    }


def context_parallel_keys(layout: Layout) -> dict:
    """mindformers' parallel_config keys of a layout's context parallelism (modules/transformer/transformer.py,
    TransformerOpParallelConfig): context_parallel always; context_parallel_algo with cp > 1 (with cp 1 mindformers
    warns that it does not take effect); ulysses_degree_in_cp with hybrid_cp only (elsewhere it warns the same)."""
    keys = {"context_parallel": layout.cp}
    if layout.cp > 1:
        keys["context_parallel_algo"] = layout.cp_algo
        if layout.cp_algo == "hybrid_cp":
            keys["ulysses_degree_in_cp"] = layout.ulysses_degree
    return keys


def context_model_keys(layout: Layout) -> dict:
    """The model_config keys context parallelism needs: use_flash_attention (tools/check_rules.py, _check_parallel
    refuses cp > 1 without it) and use_ring_attention when key/value blocks go round a ring (colossalai_cp, or
    hybrid_cp with a ring part): without it mindformers' FlashAttention gathers the whole key/value sequence on
    every device instead (modules/flash_attention.py, FlashAttention._generate_flash_attention_strategy: key/value
    split (dp, 1, mp) unless use_ring_attention, then (dp, cp, mp))."""
    return {"use_flash_attention": True, "use_ring_attention": layout.ring > 1}


def mindformers_parallel_yaml(layout: Layout, **options) -> str:
    """mindformers_parallel_config() as YAML text, under a comment naming the plan and the less obvious keys."""
    doc = mindformers_parallel_config(layout, **options)
    s = layout.row()
    head = (f"# planned: dp={s['dp']} mp={s['mp']} pp={s['pp']} cp={s['cp']}"
            + (f" ({s['cp_algo']})" if s["cp"] > 1 else "") + f", micro_batch {s['micro_batch']} x {s['accum']} "
            f"micro-steps, recompute {s['recompute']}, optimizer_shard {s['optimizer_shard']}\n"
            "# parallel_mode: 0 data, 1 semi-auto, 2 auto parallel; search_mode: used by auto_parallel only;\n"
            "# enable_parallel_optimizer: shard optimizer states (and weights) over dp; micro_batch_num: pipeline\n"
            "# micro-batches per step (>= pipeline_stage); runner_config.batch_size: per device and micro-step\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def run_yaml(cfg: RunConfig, layout: Layout, *, model: ModelConfig | None = None, devices: int = 1,
             max_device_memory_gib: float | None = None, resume: bool = False,
             resume_from: str | None = None, src_strategy: str | None = None) -> dict:
    """A labkit run as a mindformers run YAML (keys as in r1.5.0 configs/llama2/pretrain_llama2_7b.yaml, types
    available in the installed mindformers 1.9.0): the model computing as `cfg.train.amp_level` says
    (labkit.config.AMP_LEVELS), the optimizer, the schedule, the data and `layout`'s parallel blocks.
    `max_device_memory_gib` is the memory pool MindSpore may take per device (None on CPU: not set).
    A context-parallel layout is checked against mindformers' own rules first (context_parallel.check_mindformers).
    With flash attention from 2048 tokens on, the compressed causal mask (cp_terms.mask_compression).
    `resume_from`: an earlier run's checkpoint folder (its rank_N folders) to continue from (`resume_keys`);
    `src_strategy`: that run's strategy folder or file, when it trained under another layout or number of cards."""
    t, p = cfg.train, cfg.parallel
    model = model or cfg.model
    mode = p.parallel_mode if p.parallel_mode in PARALLEL_MODES else "data_parallel"
    par = mindformers_parallel_config(layout, parallel_mode=mode, search_mode=p.search_mode,
                                      num_layers=model.num_layers)
    par["use_parallel"] = devices > 1
    model_config = llama_config_kwargs(model, seq_length=cfg.data.seq_len, batch_size=t.micro_batch,
                                       backend=Backend(device_target=p.device_target, **AMP_LEVELS[t.amp_level]))
    model_config.update(par.pop("model", {}).get("model_config", {}))
    if mask_compression(cfg.data.seq_len, model_config["use_flash_attention"]):
        # a 2048 x 2048 uint8 mask in place of an [s, s] one and a [b, 1, s, s] one per micro-batch (cp_terms.mask_bytes)
        model_config["use_attn_mask_compression"] = True
    check_mindformers(model, layout, seq_len=cfg.data.seq_len, parallel_mode=mode,
                      flash_attention=model_config["use_flash_attention"] and p.device_target == "Ascend")
    dataset = {"data_loader": {"type": "MindDataset", "dataset_dir": cfg.data.dataset or "",
                               "shuffle": cfg.data.shuffle},
               "input_columns": ["input_ids"], "num_parallel_workers": cfg.data.num_parallel_workers,
               "python_multiprocessing": False, "drop_remainder": True, "batch_size": t.micro_batch, "repeat": 1,
               "numa_enable": False, "prefetch_size": cfg.data.prefetch}
    scale = (1.0 if not loss_scaled(t.amp_level) else
             {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": t.loss_scale, "scale_factor": t.scale_factor,
              "scale_window": t.scale_window})
    context = {"mode": 0 if t.mode == "graph" else 1, "device_target": p.device_target, "max_call_depth": 10000,
               "save_graphs": False, "device_id": 0}
    if max_device_memory_gib is not None:
        context["max_device_memory"] = f"{max(1.0, max_device_memory_gib):g}GB"
    return {
        "seed": t.seed, "output_dir": "./output", "run_mode": "train",
        **resume_keys(t.init_checkpoint, resume, resume_from, src_strategy),
        "trainer": {"type": "CausalLanguageModelingTrainer", "model_name": model.name},
        "runner_config": {"epochs": 1, "batch_size": t.micro_batch, "sink_mode": True, "sink_size": 1,
                          **par.pop("runner_config")},
        "optimizer": {"type": "AdamW", "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay},
        "lr_schedule": {"type": "CosineWithWarmUpLR", "learning_rate": t.lr, "lr_end": t.min_lr,
                        "warmup_steps": t.warmup_steps, "total_steps": t.decay_steps},
        "train_dataset": dataset,
        "train_dataset_task": {"type": "CausalLanguageModelDataset", "dataset_config": dataset},
        **par,
        "context": context,
        "model": {"model_config": {"type": "LlamaConfig", **model_config}, "arch": {"type": "LlamaForCausalLM"}},
        "processor": {"return_tensors": "ms", "type": "LlamaProcessor",
                      "tokenizer": {"type": "LlamaTokenizer", "pad_token": "<unk>",
                                    "vocab_file": str(Path(cfg.data.tokenizer) / "tokenizer.model")}},
        "runner_wrapper": {"type": "MFTrainOneStepCell", "scale_sense": scale, "use_clip_grad": t.grad_clip > 0,
                           "max_grad_norm": t.grad_clip or 1.0},
        "callbacks": [{"type": "MFLossMonitor"},
                      {"type": "CheckpointMonitor", "prefix": model.name, "integrated_save": False,
                       "save_checkpoint_steps": t.save_every or t.steps, "keep_checkpoint_max": t.keep_checkpoints}],
    }


# where mindformers saves a run's shards (rank_N/ folders) and its strategy files (ckpt_strategy_rank_N.ckpt):
# mindformers/utils/file_utils.py `set_checkpoint_save_path`, `set_strategy_save_path`, under output_dir ("./output"
# in the YAML run_yaml writes)
CHECKPOINTS, STRATEGY = "./output/checkpoint", "./output/strategy"


def resume_keys(init_checkpoint: str | None, resume: bool, resume_from: str | None,
                src_strategy: str | None) -> dict:
    """The four keys with which mindformers 1.9 starts from weights or continues a run (read in
    trainer/trainer.py `Trainer._validate_auto_trans_ckpt_requirements` and trainer/utils.py
    `transform_and_load_checkpoint`, `load_resume_context_from_checkpoint`):
      load_checkpoint           a complete checkpoint file, or a folder of rank_N folders (one shard per card);
      resume_training           True: continue from the newest checkpoint of each rank_N (weights, optimizer
                                state, step, loss scale) instead of only starting from its weights;
      src_strategy_path_or_dir  the strategy the shards were saved under (mindformers writes it to
                                output/strategy: one file per rank, merged by mindformers before use);
      auto_trans_ckpt           True: mindformers reshards the checkpoint from that strategy to this run's
                                (TransformCkpt, MindSpore's transform_checkpoints) before loading it; needed when
                                the earlier run had another layout or number of cards. Over several nodes its
                                output_dir must be on storage every node sees (mindformers refuses otherwise).
    Continuing a run takes precedence over init weights: `resume_from` (another run's checkpoints), or with
    `resume` alone this run's own (mindformers saves them to output_dir/checkpoint, output_dir "./output" here:
    CHECKPOINTS). `src_strategy` needs `resume_from`."""
    if src_strategy and not resume_from:
        raise LabkitError("src_strategy is set without resume_from: a strategy describes the shards of a "
                          "checkpoint to continue from", "give resume_from (the earlier run's checkpoint folder) "
                          "too, or leave src_strategy unset")
    if resume_from:
        return {"load_checkpoint": str(resume_from), "auto_trans_ckpt": bool(src_strategy), "resume_training": True,
                "src_strategy_path_or_dir": str(src_strategy or "")}
    return {"load_checkpoint": CHECKPOINTS if resume else init_checkpoint or "", "auto_trans_ckpt": False,
            "resume_training": resume, "src_strategy_path_or_dir": ""}


def run_yaml_text(cfg: RunConfig, layout: Layout, **options) -> str:
    """run_yaml() as YAML text, under a comment saying how it differs from labkit's own loop."""
    t = cfg.train
    head = (f"# mindformers run YAML for the run in run.yaml beside this file (written by labkit).\n"
            f"# Start: see launch.sh. Differences from labkit's own loop: mindformers trains `epochs` passes over\n"
            f"# the dataset (no step limit: choose epochs x samples / global batch {t.global_batch} ~ steps "
            f"{t.steps});\n# recompute [n] recomputes the first n layers of each pipeline stage (labkit: "
            f"{str(t.recompute)!r}, the same memory).\n")
    return head + yaml.safe_dump(run_yaml(cfg, layout, **options), sort_keys=False, allow_unicode=True)


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


# ------------------------------------------------------------------------------------ a run YAML read back

_MODEL_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_layers", "num_heads": "num_heads",
               "n_kv_heads": "num_kv_heads", "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
               "multiple_of": "multiple_of", "ffn_dim_multiplier": "ffn_dim_multiplier",
               "tie_word_embeddings": "tie_word_embeddings"}
# the model_config keys that carry an amp level's dtypes (what llama_config_kwargs writes for AMP_LEVELS)
_DTYPE_KEYS = ("compute_dtype", "param_init_type", "softmax_compute_type", "layernorm_compute_type",
               "embedding_init_type", "rotary_dtype")


def read_run_yaml(path) -> dict:
    """What the planner needs from a mindformers run YAML, read from the keys mindformers reads: the model
    (`model.model_config`), the layout (`parallel_config`, `runner_config`, `parallel.enable_parallel_optimizer`,
    `parallel_optimizer_config`, `recompute_config`), the amp level whose dtypes the model_config carries, the
    sequence length, flash attention, ring attention and the memory pool (`context.max_device_memory`, GiB, None if
    unset). The layout's context parallelism from parallel_config's context_parallel, context_parallel_algo and
    ulysses_degree_in_cp, with mindformers' defaults (1, colossalai_cp, 1) where a key is missing.
    Returns {model, layout, amp_level, seq_len, flash_attention, ring_attention, max_device_memory_gib}."""
    doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    try:
        mc, par, pc = doc["model"]["model_config"], doc["parallel"], doc["parallel_config"]
        run, rc = doc["runner_config"], doc.get("recompute_config") or {}
    except (KeyError, TypeError) as e:
        raise LabkitError(f"{path}: not a mindformers run YAML (no {e})",
                          "give a YAML with model.model_config, parallel, parallel_config and runner_config") from None
    model = dataclasses.replace(ModelConfig(name=doc.get("trainer", {}).get("model_name", "model")),
                                **{ours: mc[theirs] for theirs, ours in _MODEL_KEYS.items() if theirs in mc})
    # mindformers' LlamaConfig takes param_init_type for a missing embedding_init_type, float32 for rotary_dtype
    dtypes = {k: mc.get(k) for k in _DTYPE_KEYS}
    dtypes["embedding_init_type"] = dtypes["embedding_init_type"] or dtypes["param_init_type"]
    dtypes["rotary_dtype"] = dtypes["rotary_dtype"] or "float32"
    level = next((name for name, d in AMP_LEVELS.items()
                  if all(llama_config_kwargs(model, seq_length=1, backend=Backend(**d))[k] == v
                         for k, v in dtypes.items())), None)
    if level is None:
        raise LabkitError(f"{path}: model_config dtypes {dtypes} are no amp level labkit knows",
                          f"use the dtypes of one of {', '.join(AMP_LEVELS)} (labkit.config.AMP_LEVELS)")
    pp = int(pc.get("pipeline_stage", 1))
    accum = int(pc.get("micro_batch_num", 1)) if pp > 1 else int(run.get("gradient_accumulation_steps", 1))
    recompute = rc.get("recompute", False)
    if isinstance(recompute, list):  # layers per stage: mindformers recomputes the first n of each
        n = model.num_layers
        recompute = f"last:{sum(recompute)}" if sum(recompute) < n else True
    opc, default = par.get("parallel_optimizer_config") or {}, OptimizerParallel()
    layout = Layout(dp=int(pc["data_parallel"]), mp=int(pc.get("model_parallel", 1)), pp=pp,
                    micro_batch=int(run["batch_size"]), accum=accum,
                    recompute=Recompute("selective") if rc.get("select_recompute") else Recompute.parse(recompute),
                    optimizer_shard=bool(par.get("enable_parallel_optimizer")),
                    sequence_parallel=bool(pc.get("use_seq_parallel")), cp=int(pc.get("context_parallel", 1)),
                    cp_algo=str(pc.get("context_parallel_algo", "colossalai_cp")),
                    ulysses_degree=int(pc.get("ulysses_degree_in_cp", 1)),
                    optimizer=OptimizerParallel(
                        level=opc.get("optimizer_level", default.level),
                        gradient_accumulation_shard=bool(opc.get("gradient_accumulation_shard")),
                        threshold_kb=int(opc.get("parallel_optimizer_threshold", default.threshold_kb)),
                        weight_shard_size=int(opc.get("optimizer_weight_shard_size", default.weight_shard_size)),
                        comm_recompute=bool(rc.get("parallel_optimizer_comm_recompute"))))
    pool = (doc.get("context") or {}).get("max_device_memory")
    return {"model": model, "layout": layout, "amp_level": level, "seq_len": int(mc["seq_length"]),
            "flash_attention": bool(mc.get("use_flash_attention")),
            "ring_attention": bool(mc.get("use_ring_attention")),
            "max_device_memory_gib": float(str(pool).upper().removesuffix("GB")) if pool else None}
