"""The loader's order contract. One global batch G = micro_batch x dp_size x accum samples per step; micro-step j
takes G's slice [j*mb*dp, (j+1)*mb*dp) and rank r takes its r-th micro-batch of that slice. The order of an epoch
depends only on (seed, epoch), so any dp x accum split of the same global batch sees the same samples per step,
and a resumed run reads exactly the batches the uninterrupted run would have read."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np

from labkit.config import DataConfig
from labkit.data.dataset import RECORD, read_stats
from labkit.errors import LabkitError
from labkit.logs import quiet_mindformers
from labkit.paths import lab_path


def epoch_order(n_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    return np.random.default_rng(seed + epoch).permutation(n_samples) if shuffle else np.arange(n_samples)


def global_batch_size(micro_batch: int, dp_size: int = 1, accum: int = 1) -> int:
    return micro_batch * dp_size * accum


def check_layout(n_samples: int, micro_batch: int, dp_size: int, dp_rank: int, accum: int) -> int:
    for name, v in (("micro_batch", micro_batch), ("dp_size", dp_size), ("accum", accum)):
        if v < 1:
            raise LabkitError(f"{name} must be at least 1, got {v}")
    if not 0 <= dp_rank < dp_size:
        raise LabkitError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    g = global_batch_size(micro_batch, dp_size, accum)
    if n_samples < g:
        raise LabkitError(f"the dataset has {n_samples} samples, fewer than one global batch of {g} "
                          f"(micro_batch {micro_batch} x dp {dp_size} x accum {accum})",
                          f"give at least {g} samples (more text or a shorter seq_len) or a smaller batch")
    return n_samples // g


def rank_indices(n_samples: int, micro_batch: int, *, seed: int, epoch: int, dp_size: int = 1, dp_rank: int = 0,
                 accum: int = 1, shuffle: bool = True) -> np.ndarray:
    """Sample indices rank `dp_rank` reads in `epoch`: shape [steps_per_epoch, accum, micro_batch]."""
    steps = check_layout(n_samples, micro_batch, dp_size, dp_rank, accum)
    g = global_batch_size(micro_batch, dp_size, accum)
    order = epoch_order(n_samples, seed, epoch, shuffle)[: steps * g]
    return order.reshape(steps, accum, dp_size, micro_batch)[:, :, dp_rank, :]


def make_loader(dataset_dir, micro_batch: int, *, seed: int, dp_size: int = 1, dp_rank: int = 0, accum: int = 1,
                start_step: int = 0, data: DataConfig = DataConfig()):
    """Infinite iterator of int32 arrays [micro_batch, seq_len + 1]: `accum` of them per optimizer step, in the
    order described in the module docstring, starting at optimizer step `start_step` (skipped samples are not read).
    From `data`: shuffle, num_parallel_workers and prefetch (how MindDataset reads; the order depends on shuffle
    alone)."""
    shuffle, num_parallel_workers, prefetch = data.shuffle, data.num_parallel_workers, data.prefetch
    stats = read_stats(dataset_dir)
    n = stats["n_samples"]
    steps_per_epoch = check_layout(n, micro_batch, dp_size, dp_rank, accum)
    if start_step < 0:
        raise LabkitError(f"start_step {start_step} must be >= 0")
    if num_parallel_workers < 1 or prefetch < 1:
        raise LabkitError("num_parallel_workers and prefetch must be at least 1")
    if num_parallel_workers > (os.cpu_count() or 1):
        raise LabkitError(f"num_parallel_workers {num_parallel_workers} exceeds this machine's {os.cpu_count()} CPUs "
                          "(MindSpore refuses more workers than CPUs)", f"use at most {os.cpu_count()}")
    record = str(lab_path(dataset_dir) / RECORD)

    def batches():
        quiet_mindformers()
        import mindspore.dataset as ds

        ds.config.set_prefetch_size(prefetch)
        step = start_step
        while True:
            epoch, first = divmod(step, steps_per_epoch)
            idx = rank_indices(n, micro_batch, seed=seed, epoch=epoch, dp_size=dp_size, dp_rank=dp_rank,
                               accum=accum, shuffle=shuffle)[first:]
            pipe = ds.MindDataset(record, columns_list=["input_ids"], sampler=ds.SubsetSampler(idx.ravel().tolist()),
                                  num_parallel_workers=num_parallel_workers)
            pipe = pipe.batch(micro_batch, drop_remainder=True)
            for (x,) in pipe.create_tuple_iterator(output_numpy=True, num_epochs=1):
                yield x
            step = (epoch + 1) * steps_per_epoch

    return batches()


def check_shard_balance(dataset_dir, micro_batch: int, dp_size: int, accum: int, steps: int, seed: int,
                        shuffle: bool = True) -> dict:
    """What the data-parallel ranks actually receive over `steps` optimizer steps, read from the arrays `make_loader`
    yields for every dp_rank (the path training reads) and for one card that takes the whole global batch (micro_batch
    x dp_size, same accum); nothing is inferred from the index plan. A sample is known by its contents.

    - `shared_samples`: samples that reached two or more ranks within one epoch (a sound split has none);
    - `steps_matching_single_card`: steps at which the ranks' samples together are exactly the single card's;
    - `epoch_samples_covered`: distinct samples the ranks together read in epoch 0 (None when `steps` ends earlier);
    - `tokens_per_rank` / `documents_per_rank`: tokens and document ends (EOS tokens) each rank received. Packed
      samples hold no padding, so every token is real content; documents per rank need not be equal."""
    stats = read_stats(dataset_dir)
    eos_id = stats.get("eos_id")
    if steps < 1:
        raise LabkitError(f"steps {steps} must be at least 1")
    steps_per_epoch = check_layout(stats["n_samples"], micro_batch, dp_size, 0, accum)

    def received(mb, size, rank):
        """[steps, rows of one optimizer step] as row bytes, plus token and EOS counts."""
        it = make_loader(dataset_dir, mb, seed=seed, dp_size=size, dp_rank=rank, accum=accum,
                         data=DataConfig(shuffle=shuffle))
        rows, n_tok, n_doc = [], 0, 0
        for _ in range(steps):
            xs = [next(it) for _ in range(accum)]
            rows.append([r.tobytes() for x in xs for r in x])
            n_tok += sum(int(x.size) for x in xs)
            n_doc += sum(int(np.count_nonzero(x == eos_id)) for x in xs) if eos_id is not None else 0
        it.close()  # ends the MindDataset pipeline of this rank
        return rows, n_tok, n_doc

    ranks = [received(micro_batch, dp_size, r) for r in range(dp_size)]
    single = received(micro_batch * dp_size, 1, 0)[0]
    shared = 0
    for e in range(0, steps, steps_per_epoch):
        seen = [{b for t in range(e, min(e + steps_per_epoch, steps)) for b in rows[t]} for rows, _, _ in ranks]
        shared += sum(c > 1 for c in Counter(b for s in seen for b in s).values())
    matching = sum(sorted(b for rows, _, _ in ranks for b in rows[t]) == sorted(single[t]) for t in range(steps))
    covered = (len({b for rows, _, _ in ranks for t in range(steps_per_epoch) for b in rows[t]})
               if steps >= steps_per_epoch else None)
    tokens, docs = [r[1] for r in ranks], [r[2] for r in ranks]

    def imbalance(v):
        return (max(v) - min(v)) / max(np.mean(v), 1e-9)

    return dict(dp_size=dp_size, steps=steps, micro_batch=micro_batch, accum=accum, steps_per_epoch=steps_per_epoch,
                shared_samples=shared, steps_matching_single_card=matching, epoch_samples_covered=covered,
                tokens_per_rank=tokens, documents_per_rank=docs, max_imbalance=round(imbalance(tokens), 6),
                document_imbalance=round(imbalance(docs), 6))
