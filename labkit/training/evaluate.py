"""Validation loss during training: the mean loss over a held-out set, one compiled forward graph, no gradients.

The validation set (`labkit data build --val-fraction`, `<dataset>/val`) is read into memory once; the n samples an
evaluation reads (all, or `train.eval_samples` of them, below) are cut into B = n // micro_batch batches in file
order (a tail shorter than a batch is left out, the same for every layout). Under data parallel, rank r evaluates
batches r, r + dp, r + 2 dp, ...; the ranks' loss sums and batch counts are added over ranks, so the figure is the
one a single card evaluating all B batches gets (up to float summation order). Every batch holds micro_batch x
seq_len labels, so the mean of batch means is the mean over tokens.

`train.eval_samples` N > 0 reads N samples spread evenly over the set (every (n_val - 1) / (N - 1)-th one), the
same ones at every evaluation, so the points of a curve compare like with like and no part of the set (a language,
a book) is left out, as HF's `max_eval_samples` or Megatron's `--eval-iters` bound the cost: an evaluation of the
whole 2% split of the shipped corpus reads 320 samples at seq 128, as many tokens as 40 training steps at batch 8.

Evaluation reads no training data, updates nothing and draws no random numbers: a run with evaluation trains
exactly like one without (tests/test_train.py checks it).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from labkit.data import dataset as data
from labkit.errors import LabkitError
from labkit.model.llama import build_model
from labkit.paths import lab_path
from labkit.training.generate import load_checkpoint
from labkit.training.world import all_reduce_sum


def spread(samples: np.ndarray, n: int) -> np.ndarray:
    """The validation samples an evaluation reads: all of them (n = 0), or n spread evenly over the set."""
    if not n or n >= len(samples):
        return samples
    return samples[np.linspace(0, len(samples) - 1, n).round().astype(int)]


def rank_batches(n_samples: int, micro_batch: int, dp_size: int = 1, dp_rank: int = 0) -> list[slice]:
    """The validation batches (sample slices) rank `dp_rank` evaluates."""
    n_batches = n_samples // micro_batch
    return [slice(b * micro_batch, (b + 1) * micro_batch) for b in range(dp_rank, n_batches, dp_size)]


class Evaluator:
    """`evaluator()` -> {val_loss, val_ppl, val_batches}: the mean loss of `net` (a training-mode model that
    returns its loss) over `samples` [n, seq_len + 1]."""

    def __init__(self, net, samples: np.ndarray, micro_batch: int, dp_size: int = 1, dp_rank: int = 0,
                 world_size: int = 1, eval_samples: int = 0):
        import mindspore as ms

        samples = spread(samples, eval_samples)
        n_batches = len(samples) // micro_batch
        if n_batches < max(dp_size, 1):
            what = f"train.eval_samples {eval_samples} is" if eval_samples and len(samples) == eval_samples else \
                f"the validation set has {len(samples)} samples,"
            raise LabkitError(f"{what} fewer than one batch of {micro_batch} per data-parallel rank ({dp_size})",
                              "raise data.val_fraction or train.eval_samples, lower train.micro_batch, or set "
                              "train.eval_every 0")
        self.samples, self.world_size, self.n_batches = samples, world_size, n_batches
        self.batches = rank_batches(len(samples), micro_batch, dp_size, dp_rank)

        @ms.jit
        def loss(x):
            return net(x)

        self._loss = loss

    def __call__(self) -> dict:
        import mindspore as ms

        total = sum(float(self._loss(ms.Tensor(self.samples[b])).asnumpy()) for b in self.batches)
        count = float(len(self.batches))
        if self.world_size > 1:
            total, count = all_reduce_sum([total, count])
        mean = total / count
        return {"val_loss": mean, "val_ppl": math.exp(min(mean, 700.0)), "val_batches": int(count)}


def validation_set(run, val_fraction: float | None = None) -> tuple:
    """(validation folder, held_out) for a run config: its own validation set when it has one; otherwise the split
    `val_fraction` (default 0.02) holds out of the same corpus, whose documents that run may have read."""
    d = run.data
    own = data.val_dir(d.dataset) if d.dataset else None
    if own is None and not d.dataset and d.val_fraction:
        own = data.val_dir(data.ensure_dataset(d.seq_len, corpus=d.corpus, tokenizer_dir=d.tokenizer,
                                               val_fraction=d.val_fraction, val_seed=d.val_seed, progress=False))
    if own is not None and val_fraction in (None, d.val_fraction):
        return own, True
    stats = data.read_stats(d.dataset) if d.dataset else {}
    first_use = not d.dataset or data.CACHE.resolve() in Path(d.dataset).resolve().parents
    corpus = d.corpus if first_use else [lab_path(c) for c in stats["corpus"]]
    built = data.ensure_dataset(d.seq_len, corpus=corpus, tokenizer_dir=stats.get("tokenizer", d.tokenizer),
                                text_field=stats.get("text_field", "text"),
                                split_on_blank_lines=stats.get("split_on_blank_lines", False),
                                val_fraction=val_fraction or 0.02, val_seed=d.val_seed, progress=False)
    return data.val_dir(built), False


def evaluate_checkpoint(checkpoint, val_fraction: float | None = None) -> dict:
    """val_loss / val_ppl of a training checkpoint (a run folder or a checkpoints/step_* folder), single card, on
    `validation_set(run, val_fraction)`; `held_out` says whether training never read those documents."""
    import mindspore as ms


    ck = load_checkpoint(checkpoint)
    run = ck["run"]
    vdir, held_out = validation_set(run, val_fraction)
    ms.set_context(mode=ms.GRAPH_MODE)
    mb = run.train.micro_batch
    model = build_model(ck["model_cfg"], seq_length=run.data.seq_len, batch_size=mb)
    ms.load_param_into_net(model, ck["weights"], strict_load=True)
    model.set_train(True)  # the training-mode model returns the loss the trainer logs
    out = Evaluator(model, data.read_samples(vdir), mb, eval_samples=run.train.eval_samples)()
    return dict(out, step=ck["step"], checkpoint=str(ck["checkpoint"]), validation=str(vdir), held_out=held_out)
