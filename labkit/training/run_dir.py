"""One validator for what a run reads and writes before anything trains: the dataset (found, or built once on first
use; its seq_len and vocabulary against the config), the initial checkpoint, and the run folder (resume needs a
complete checkpoint below train.steps; an old run is never silently mixed in).

`labkit launch` (before any process starts), notebook 07's parameter check and `Trainer.__init__` all call these,
each with its own spelling of the knobs (`--resume` on the command line, `-p resume True` in papermill)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError
from labkit.training import checkpoint


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
    from labkit.data import dataset as data

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
    """The dataset's samples have the config's seq_len and its tokens fit the model's vocabulary."""
    from labkit.data import dataset as data

    path = dataset_path(cfg)
    stats = data.read_stats(path)
    if stats.get("seq_len") not in (None, cfg.data.seq_len):
        raise LabkitError(f"dataset {path} holds samples of seq_len {stats['seq_len']}, the config asks for "
                          f"{cfg.data.seq_len}", "set data.seq_len to match or rebuild the dataset")
    vocab = cfg.model_config().vocab_size
    if stats.get("vocab_size") and stats["vocab_size"] > vocab:
        raise LabkitError(f"dataset tokenizer has {stats['vocab_size']} tokens, the model's vocab_size is {vocab}",
                          "use the matching tokenizer or resize the embeddings")
    return DatasetCheck(path=path, n_samples=int(stats.get("n_samples", 0)), stats=stats)


def check_init_checkpoint(path) -> Path | None:
    """train.init_checkpoint resolved, or None when not set."""
    if not path:
        return None
    init = Path(path).expanduser()
    if not init.exists():
        raise LabkitError(f"train.init_checkpoint {init} not found",
                          "give a `labkit convert hf2ms` output folder, a checkpoint folder or a .ckpt file")
    return init.resolve()


def holds_run(output) -> bool:
    """True when `output` holds a complete checkpoint or a metrics log."""
    out = Path(output)
    return bool(checkpoint.list_checkpoints(out)) or (out / "metrics.jsonl").exists()


def check_run_folder(output, *, resume: bool, overwrite: bool, steps: int, spelling: Spelling = CLI,
                     shared: bool = False) -> RunFolder:
    """Resume needs a complete checkpoint below `steps`; without resume, a folder holding a run needs overwrite.
    `shared` adds that several nodes must see the same folder."""
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
    return RunFolder(output=out, resume=True, start_step=start, checkpoint=ck)
