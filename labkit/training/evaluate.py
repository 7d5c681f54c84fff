"""Validation loss during training: the mean loss over a held-out set, one compiled forward graph, no gradients.

The validation set (`labkit data build --val-fraction`, `<dataset>/val`) is read into memory once and cut into
B = n_val // micro_batch batches in file order (a tail shorter than a batch is left out, the same for every
layout). Under data parallel, rank r evaluates batches r, r + dp, r + 2 dp, ...; the ranks' loss sums and batch
counts are added over ranks, so the figure is the one a single card evaluating all B batches gets (up to float
summation order). Every batch holds micro_batch x seq_len labels, so the mean of batch means is the mean over tokens.

Evaluation reads no training data, updates nothing and draws no random numbers: a run with evaluation trains
exactly like one without (tests/test_train.py checks it).
"""
from __future__ import annotations

import math

import numpy as np

from labkit.errors import LabkitError


def rank_batches(n_samples: int, micro_batch: int, dp_size: int = 1, dp_rank: int = 0) -> list[slice]:
    """The validation batches (sample slices) rank `dp_rank` evaluates."""
    n_batches = n_samples // micro_batch
    return [slice(b * micro_batch, (b + 1) * micro_batch) for b in range(dp_rank, n_batches, dp_size)]


class Evaluator:
    """`evaluator()` -> {val_loss, val_ppl, val_batches}: the mean loss of `net` (a training-mode model that
    returns its loss) over `samples` [n, seq_len + 1]."""

    def __init__(self, net, samples: np.ndarray, micro_batch: int, dp_size: int = 1, dp_rank: int = 0,
                 world_size: int = 1):
        import mindspore as ms

        n_batches = len(samples) // micro_batch
        if n_batches < max(dp_size, 1):
            raise LabkitError(f"the validation set has {len(samples)} samples, fewer than one batch of "
                              f"{micro_batch} per data-parallel rank ({dp_size})",
                              "raise data.val_fraction, lower train.micro_batch, or set train.eval_every 0")
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
            from labkit.training.world import all_reduce_sum

            total, count = all_reduce_sum([total, count])
        mean = total / count
        return {"val_loss": mean, "val_ppl": math.exp(min(mean, 700.0)), "val_batches": int(count)}


def evaluate_checkpoint(checkpoint, val_fraction: float | None = None) -> dict:
    """val_loss / val_ppl of a training checkpoint (a run folder or a checkpoints/step_* folder), single card.

    The validation set is the run's own (`data.val_fraction`); a run trained without one can be measured on the split
    `val_fraction` would hold out, whose documents that run may have read (`held_out` says False then)."""
    import mindspore as ms

    from labkit.data import dataset as data
    from labkit.model.llama import build_model
    from labkit.training.generate import load_checkpoint

    ck = load_checkpoint(checkpoint)
    run, frac = ck["run"], val_fraction if val_fraction is not None else ck["run"].data.val_fraction
    if run.data.dataset:
        vdir = data.val_dir(run.data.dataset)
    else:
        vdir = data.val_dir(data.ensure_dataset(run.data.seq_len, corpus=run.data.corpus,
                                                tokenizer_dir=run.data.tokenizer, val_fraction=frac,
                                                val_seed=run.data.val_seed, progress=False))
    if vdir is None:
        raise LabkitError(f"{run.data.dataset} has no validation set", "build it with --val-fraction")
    ms.set_context(mode=ms.GRAPH_MODE)
    mb = run.train.micro_batch
    model = build_model(ck["model_cfg"], seq_length=run.data.seq_len, batch_size=mb)
    ms.load_param_into_net(model, ck["weights"], strict_load=True)
    model.set_train(True)  # the training-mode model returns the loss the trainer logs
    out = Evaluator(model, data.read_samples(vdir), mb)()
    return dict(out, step=ck["step"], checkpoint=str(ck["checkpoint"]), val_fraction=frac,
                held_out=bool(run.data.val_fraction) and frac == run.data.val_fraction)
