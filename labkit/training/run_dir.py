"""One validator for what a run reads and writes before anything trains, and for every pair of artefacts a command
combines, checked before MindSpore builds anything (from files' headers: no framework, no checkpoint loaded):
- the dataset (found, or built once on first use) against the config: seq_len, vocabulary, the tokenizer's end-of-
  document id against the model's eos_token_id, and (a prebuilt dataset) against data.tokenizer's vocabulary;
- an initial checkpoint (train.init_checkpoint) against the model: every parameter's name, shape and dtype;
- the run folder: resume needs a complete checkpoint below train.steps; an old run is never silently mixed in;
- a resumed checkpoint against the config (`check_resume`, `check_resume_data`), under these rules:
    may not change: the model (every parameter's shape and the settings shapes cannot show: num_heads, rope_theta,
      rms_norm_eps, bos/eos/pad ids; max_position_embeddings may, RoPE has no table to resize); the tokenizer
      (token ids must keep their meaning); the weights' dtype and, for amp_level O1-O3, the loss-scale state (so
      amp_level may change only between levels that keep both: O1 <-> O2, or O1/O2 -> O0); and, while the dataset
      stays the same, the data order: train.seed, data.shuffle and the global batch (micro_batch x dp x accum),
      since a resumed run must read exactly the batches the uninterrupted run would have read (labkit.data.loader);
      how the global batch is split (micro_batch, dp, accum) may change;
    may change: steps, the learning-rate schedule and optimizer settings, save/eval/sample cadence, kernels,
      recompute, loader workers, the parallel layout at the same global batch; and the dataset itself (another
      seq_len or corpus, same tokenizer: a curriculum such as notebook 08a's short-then-long sequences, which
      continues at batch `step` of the new dataset and may use another global batch there);
- a training checkpoint used for generation against the config recorded with it and the tokenizer paired with it.
Conversion and parity (labkit.weights, a lower layer) use the same checks from labkit.weights.convert.

`labkit launch` (before any process starts), notebook 07's parameter check and `Trainer.__init__` all call these,
each with its own spelling of the knobs (`--resume` on the command line, `-p resume True` in papermill)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from labkit.config import AMP_LEVELS, RunConfig, load
from labkit.data import dataset as data
from labkit.data.dataset import CACHE
from labkit.errors import LabkitError
from labkit.paths import lab_path
from labkit.training import checkpoint
from labkit.weights.convert import TOKENIZER_FILES, run_tokenizer
from labkit.weights.formats import ckpt_index, weights_file
from labkit.weights.pairs import (
    STRUCTURE,
    ParamDtype,
    check_converted,
    check_tokenizer_fits,
    check_weights,
    tokenizer_span,
)


@dataclass(frozen=True)
class Spelling:
    """How the caller's user writes each knob, for the fix in an error message."""

    resume: str = "--resume"
    overwrite: str = "--overwrite"
    steps: str = "--steps N"
    output: str = "--output"
    run_without_resume: str = "run without --resume first"


CLI = Spelling()
PAPERMILL = Spelling(resume="-p resume True", overwrite="-p overwrite True", steps="-p steps N",
                     output="output_dir", run_without_resume="run once without resume first")


@dataclass(frozen=True)
class DatasetCheck:
    """A dataset that fits the config."""

    path: Path  # absolute
    n_samples: int
    stats: dict


@dataclass(frozen=True)
class RunFolder:
    """A run folder that may be written: fresh, overwritten or resumed."""

    output: Path  # absolute
    resume: bool
    start_step: int  # the step training continues from (resume) or 0
    checkpoint: Path | None  # the checkpoint a resume starts from


def dataset_path(cfg) -> Path:
    """cfg.data.dataset resolved (relative paths from the lab root's data/, see labkit.paths.lab_path), or the
    shipped corpus's dataset for this seq_len, built here once on first use."""
    if not cfg.data.dataset:
        return Path(data.ensure_dataset(cfg.data.seq_len, corpus=cfg.data.corpus, tokenizer_dir=cfg.data.tokenizer,
                                        val_fraction=cfg.data.val_fraction, val_seed=cfg.data.val_seed)).resolve()
    given = Path(cfg.data.dataset).expanduser()
    path = given if given.is_absolute() else data.lab_path(cfg.data.dataset)
    if not path.is_dir():
        raise LabkitError(f"data.dataset {cfg.data.dataset} not found (looked at {path.resolve()})",
                          "build it with `labkit data build ...`, fix the path, or set data.dataset: null to build "
                          "the shipped corpus on first use")
    return path.resolve()


def check_dataset(cfg) -> DatasetCheck:
    """The dataset's samples have the config's seq_len, its tokens fit the model's vocabulary, it separates
    documents with the model's eos_token_id, and (a prebuilt dataset) it was tokenized with data.tokenizer's
    vocabulary."""
    path = dataset_path(cfg)
    stats = data.read_stats(path)
    if stats.get("seq_len") not in (None, cfg.data.seq_len):
        raise LabkitError(f"dataset {path} holds samples of seq_len {stats['seq_len']}, the config asks for "
                          f"{cfg.data.seq_len}", "set data.seq_len to match or rebuild the dataset")
    model = cfg.model_config()
    made_by = f"tokenizer {stats.get('tokenizer')}"
    if stats.get("vocab_size") and stats["vocab_size"] > model.vocab_size:
        raise LabkitError(f"dataset {path} ({made_by}) has {stats['vocab_size']} token ids, the model's "
                          f"vocab_size is {model.vocab_size}", "use the matching tokenizer or resize the embeddings")
    if stats.get("eos_id") is not None and stats["eos_id"] != model.eos_token_id:
        raise LabkitError(f"dataset {path} ends documents with token id {stats['eos_id']} ({made_by}'s eos), the "
                          f"model's eos_token_id is {model.eos_token_id}",
                          f"set model.eos_token_id={stats['eos_id']} (and bos/pad to that tokenizer's), or rebuild "
                          "the dataset with the tokenizer the model expects")
    span = tokenizer_span(lab_path(cfg.data.tokenizer)) if cfg.data.dataset and cfg.data.tokenizer else None
    if span and stats.get("vocab_size") and span[0] != stats["vocab_size"]:
        raise LabkitError(f"dataset {path} was tokenized with {stats['vocab_size']} token ids ({made_by}), "
                          f"data.tokenizer {cfg.data.tokenizer} has {span[0]} ({span[1]})",
                          f"set data.tokenizer to the dataset's tokenizer ({stats.get('tokenizer')}), or rebuild "
                          f"the dataset with `labkit data build --tokenizer {cfg.data.tokenizer} ...`")
    return DatasetCheck(path=path, n_samples=int(stats.get("n_samples", 0)), stats=stats)


def check_init_checkpoint(path, cfg: RunConfig | None = None) -> Path | None:
    """train.init_checkpoint resolved, or None when not set. With `cfg`, its weights must be the config's model:
    every parameter's name, shape and dtype (the dtype of train.amp_level: MindSpore loads no other), and the
    structure recorded beside them (a converted directory's model.yaml, a checkpoint's state.json)."""
    if not path:
        return None
    init = Path(path).expanduser()
    if not init.exists():
        raise LabkitError(f"train.init_checkpoint {init} not found",
                          "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
    init = init.resolve()
    if cfg is None:
        return init
    ckpt = weights_file(init)
    if ckpt is None:
        raise LabkitError(f"train.init_checkpoint {init} holds no weights (model.ckpt, state.ckpt or a .ckpt file)",
                          "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
    source, where = _recorded_model(ckpt)
    level = cfg.train.amp_level
    dtype = AMP_LEVELS[level]["param_dtype"]
    check_weights(f"train.init_checkpoint {ckpt}", ckpt_index(ckpt, any_dtype=True), cfg.model_config(),
                  f"set the model keys to the checkpoint's{f' ({where})' if where else ''}, or start from weights of "
                  "this model (another vocabulary: `labkit tokenizer resize-embeddings`)", source=source,
                  dtype=ParamDtype(dtype, f" (train.amp_level {level})",
                                   f"convert the weights to {dtype} (`labkit convert hf2ms --dtype {dtype}`), or use "
                                   "the train.amp_level whose parameters have their dtype (O3: float16, the others "
                                   "float32)"))
    return init


def _recorded_model(ckpt: Path):
    """(ModelConfig, file) recorded beside a weights file: a converted directory's model.yaml (checked against its
    model.ckpt and tokenizer first) or a training checkpoint's state.json; (None, None) for a bare .ckpt file."""
    folder = ckpt.parent
    if ckpt.name == "model.ckpt" and (folder / "model.yaml").is_file():
        return check_converted(folder), folder / "model.yaml"
    if ckpt.name == "state.ckpt":
        old = _recorded(folder)[1]
        return (old.model_config(), folder / "state.json") if old else (None, None)
    return None, None


def _recorded(ck: Path) -> tuple[dict, RunConfig | None]:
    """(state.json, the run config recorded in it or None) of a checkpoint folder. A config this version cannot
    read (written by another labkit) is None: the weights are still checked by their shapes."""
    try:
        meta = json.loads((Path(ck) / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}, None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        return (meta if isinstance(meta, dict) else {}), None
    try:
        return meta, load(RunConfig, meta["config"], f"{Path(ck) / 'state.json'}: config")
    except LabkitError:
        return meta, None


def holds_run(output) -> bool:
    """True when `output` holds a complete checkpoint or a metrics log."""
    out = Path(output)
    return bool(checkpoint.list_checkpoints(out)) or (out / "metrics.jsonl").exists()


@dataclass(frozen=True)
class ResumeFit:
    """What a resumed checkpoint must fit: the run config (`check_resume`) and, when given, the dataset and the
    global batch (`check_resume_data`)."""

    cfg: RunConfig
    dataset: DatasetCheck | None = None
    global_batch: int | None = None


def check_run_folder(output, *, resume: bool, overwrite: bool, steps: int, spelling: Spelling = CLI,
                     shared: bool = False, fit: ResumeFit | None = None) -> RunFolder:
    """Resume needs a complete checkpoint below `steps`; without resume, a folder holding a run needs overwrite.
    `shared` adds that several nodes must see the same folder. With `fit`, a resumed checkpoint must fit it."""
    out = Path(output).expanduser().resolve()
    if not resume:
        if holds_run(out) and not overwrite:
            raise LabkitError(f"output {out} already holds a run",
                              f"continue it with {spelling.resume}, start over with {spelling.overwrite}, or "
                              f"choose another {spelling.output}")
        return RunFolder(output=out, resume=False, start_step=0, checkpoint=None)
    ck = checkpoint.newest_intact(out)  # a damaged newer one is skipped, as --resume will (and says so)
    if ck is None:
        raise LabkitError(f"{spelling.resume}: no complete checkpoint under {checkpoint.checkpoint_dir(out)}",
                          f"{spelling.run_without_resume}, or point {spelling.output} at the earlier run"
                          + ("; with several nodes the output folder must be storage every node shares"
                             if shared else ""))
    start = checkpoint.step_of(ck)
    if start >= steps:
        raise LabkitError(f"{spelling.resume}: the newest checkpoint is step {start}, already at train.steps {steps}",
                          f"raise {spelling.steps} (N > {start}) to train further")
    folder = RunFolder(output=out, resume=True, start_step=start, checkpoint=ck)
    if fit is not None:
        check_resume(folder, fit.cfg, spelling)
        if fit.dataset is not None or fit.global_batch is not None:
            check_resume_data(folder, fit.cfg, dataset=fit.dataset, global_batch=fit.global_batch, spelling=spelling)
    return folder


# ------------------------------------------------------------------------------------------ resume pairs
# The rules are in the module docstring. The checkpoint's state.json records the config of the run that wrote it:
# that, not <output>/config.yaml (rewritten when any later run starts in the folder), is the checkpoint's pair.

RESUME_MODEL = STRUCTURE + ("rope_theta", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id")


def _run_config_file(folder: RunFolder, meta: dict) -> str:
    """Where the checkpoint's own settings can be read: <output>/config.yaml when it still holds them, else the
    checkpoint's state.json."""
    cfg_file = folder.output / "config.yaml"
    try:
        if cfg_file.is_file() and yaml.safe_load(cfg_file.read_text(encoding="utf-8")) == meta.get("config"):
            return str(cfg_file)
    except (yaml.YAMLError, UnicodeDecodeError):
        pass
    return f"the config in {folder.checkpoint / 'state.json'}"


def _data_identity(c: RunConfig) -> tuple:
    """What selects a run's training data: a prebuilt dataset's folder, or what a first-use build is made from
    (`labkit launch` writes that build's cache folder into its workers' config: the same data)."""
    d = c.data
    if d.dataset:
        path = lab_path(d.dataset).resolve()
        if CACHE.resolve() not in path.parents:
            return "dataset", str(path), d.seq_len
    where = lambda x: str(lab_path(x).resolve())  # noqa: E731  (relative and absolute spellings of one folder)
    return ("built", [where(x) for x in d.corpus or []], where(d.tokenizer), d.seq_len, d.val_fraction,
            d.val_seed)


def _same_data(old: RunConfig, cfg: RunConfig) -> bool:
    return _data_identity(old) == _data_identity(cfg)


def check_resume(folder: RunFolder, cfg: RunConfig, spelling: Spelling = CLI) -> None:
    """The checkpoint a resume starts from fits `cfg`: the model (every weight's name, shape and dtype; the
    recorded model settings), the loss-scale state amp_level O1-O3 needs, and on the same dataset the data order
    (train.seed, data.shuffle). Read from state.json and state.ckpt's header only."""
    ck = folder.checkpoint
    meta, old = _recorded(ck)
    index = ckpt_index(ck / "state.ckpt", any_dtype=True)
    own = _run_config_file(folder, meta)
    new_run = f"or start a new run with another {spelling.output}"
    level, was = cfg.train.amp_level, old.train.amp_level if old else "O0"
    dtype = AMP_LEVELS[level]["param_dtype"]
    check_weights(f"checkpoint {ck}", index, cfg.model_config(), f"resume with the run's own model settings ({own}), "
                  + new_run, source=old.model_config() if old else None, keys=RESUME_MODEL,
                  dtype=ParamDtype(dtype, f" (train.amp_level {level})",
                                   f"resume with the run's train.amp_level {was} ({own}), {new_run}"))
    if level != "O0" and "loss_scale.value" not in index:
        raise LabkitError(f"checkpoint {ck} holds no loss-scale state (written with train.amp_level {was}), "
                          f"train.amp_level {level} needs it", f"resume with train.amp_level {was} ({own}), {new_run}")
    if old is None or not _same_data(old, cfg):
        return
    for key, before, now in (("train.seed", old.train.seed, cfg.train.seed),
                             ("data.shuffle", old.data.shuffle, cfg.data.shuffle)):
        if before != now:
            raise LabkitError(f"checkpoint {ck} was trained with {key} {before} on this dataset, the config asks for "
                              f"{now}: the resumed run would read other samples than the uninterrupted one",
                              f"resume with {key} {before} ({own}); to change the data order, start a new run "
                              f"with another {spelling.output}")


def check_resume_data(folder: RunFolder, cfg: RunConfig, *, dataset: DatasetCheck | None = None,
                      global_batch: int | None = None, spelling: Spelling = CLI) -> None:
    """The data a resume reads fits the checkpoint: on the same dataset the same global batch (the loader's order
    is a function of seed, epoch and global batch), on another dataset the same tokenizer."""
    ck = folder.checkpoint
    meta, old = _recorded(ck)
    if old is None:
        return
    own, new_run = _run_config_file(folder, meta), f"or start a new run with another {spelling.output}"
    same = _same_data(old, cfg)
    before = meta.get("global_batch")
    if same and global_batch is not None and before and before != global_batch:
        raise LabkitError(f"checkpoint {ck} was trained at global batch {before} on this dataset, the config gives "
                          f"{global_batch} (train.micro_batch {cfg.train.micro_batch} x dp "
                          f"{global_batch // (cfg.train.micro_batch * cfg.train.accum)} x train.accum "
                          f"{cfg.train.accum}): the resumed run would skip and repeat samples",
                          f"keep micro_batch x dp x accum = {before} (split differently if you like; "
                          f"{own}), {new_run}")
    if same or dataset is None or not dataset.stats.get("tokenizer"):
        return
    trained, now = run_tokenizer(old), lab_path(dataset.stats["tokenizer"])
    if not same_tokenizer(trained, now):
        raise LabkitError(f"dataset {dataset.path} is tokenized with {now}, checkpoint {ck} was trained on "
                          f"tokens of {trained}", f"resume on data built with {trained} (`labkit data build "
                          f"--tokenizer {trained} ...`), {new_run}")


def same_tokenizer(a, b) -> bool:
    """True when two tokenizer directories are one, or hold the same tokenizer files byte for byte."""
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    files = [n for n in TOKENIZER_FILES if (a / n).is_file() or (b / n).is_file()]
    return bool(files) and all((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes()
                               for n in files)


# ------------------------------------------------------------------------------------------ generation


def check_trained(ck: Path, run: RunConfig, tokenizer) -> None:
    """A training checkpoint used on its own (generation): its state.ckpt holds the model its state.json records,
    and the tokenizer that encodes the prompt has no id beyond that model's vocabulary."""
    model = run.model_config()
    check_weights(f"checkpoint {ck}", ckpt_index(Path(ck) / "state.ckpt", any_dtype=True), model,
                  "give a checkpoint written by labkit train (its state.ckpt and state.json belong together)",
                  against="its state.json")
    check_tokenizer_fits(tokenizer, model.vocab_size, f"checkpoint {ck}",
                         "give the tokenizer the model was trained with (the one its dataset's stats.json names; "
                         f"data.tokenizer in {Path(ck) / 'state.json'} for a dataset built on first use)")
