"""MindSpore's optimizer parallel, written out by hand: each data-parallel worker keeps only its 1/dp slice of the
weights and of the AdamW moments between steps, and all-gathers the full weights when it computes with them.

MindSpore 2.9 describes it in `mindspore/context.py`, `set_auto_parallel_context`, under
`parallel_optimizer_config`: "optimizer_level configuration is used to specify the splitting level for optimizer
sharding. It is important to note that the implementation of optimizer sharding in static graph is inconsistent
with dynamic graph like megatron, but the memory optimization effect is the same. When optimizer_level= level1,
splitting is performed on weights and optimizer state. When optimizer_level= level2, splitting is performed on
weights, optimizer state, and gradients. When optimizer_level= level3, splitting is performed on weights,
optimizer state, gradients, additionally, before the backward pass, the weights are further applied with allgather
communication to release the memory used by the forward pass allgather. ... Default: level1."

Unlike the lab's ZeRO-1/2 (labkit.byhand.data_parallel: full weights on every worker, moments and gradients sharded),
the weights themselves are sharded. The weights are cut in units (`units`: the embedding, each decoder layer, the
final norm with the head), each a flat buffer padded to a multiple of dp (`data_parallel.Buckets`); a worker holds its
1/dp slice of every unit. One optimizer step of m micro-batches:

    level1  per micro-batch: all-gather every unit (float32, the compute dtype here), forward and backward with the
            gathered weights alive from the forward to the backward, add the full gradients into a full-size
            accumulation buffer (mindformers' `accu_grads`); at the step's end one reduce-scatter of it
    level2  as level1, but each micro-batch's gradients are reduce-scattered at once and accumulated as a 1/dp slice
            (the older `gradient_accumulation_shard: True`)
    level3  as level2, and the gathered weights do not live from the forward to the backward: the forward runs unit
            by unit (gather, compute, release; only each unit's input is kept), the backward gathers each unit again
            and recomputes it under `ms.vjp` for its input and weight gradients (full recompute, one unit at a time)

then the clipped AdamW update of the slice (`data_parallel.FlatAdamW`, ZeRO's too). Only the updated slice is kept:
the next forward gathers. A reduce-scatter is the CPU stand-in (all-reduce + slice, labkit.byhand.comm).

Gathered weights are counted when they are alive: `gathered` adds a gathered unit's bytes and a finalizer takes
them off when Python frees the tensor (the code drops them when its unit is done), so the peak is what this
worker's step held at once, not a formula."""
from __future__ import annotations

import weakref

from labkit.byhand.comm import Op, nbytes, sum_over
from labkit.byhand.data_parallel import Buckets, FlatAdamW
from labkit.byhand.worker import Held, Worker
from labkit.model import scratch


def units(cfg) -> list[list[str]]:
    """The parameters of each unit gathered at once: the embedding, each decoder layer, the final norm and head."""
    layers = [[scratch.LAYER.format(i) + k for k in scratch.LAYER_KEYS] for i in range(cfg.num_layers)]
    return [[scratch.EMBED]] + layers + [[scratch.NORM] + ([] if cfg.tie_word_embeddings else [scratch.HEAD])]


class OptimizerParallel(Worker):
    """A data-parallel worker of MindSpore's optimizer parallel at `layout.opt_level` 1, 2 or 3 (module docstring).

    `bytes_held()`: "params" the weight slice kept between steps, "grads" the gradient buffer at the update (full
    accumulation buffer at level1, a slice at level2/3), "optimizer" the moments' slices, "gathered" the peak of
    gathered full weights alive at once during a step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mine = self.buckets.own(self.params)  # this worker's weight slice: all it keeps of the weights
        self.params = {}
        self.alive, self.peak, self.held_grads = 0, 0, 0

    def make_optimizer(self) -> FlatAdamW:
        """AdamW on the weight slice, over one flat buffer per unit (`buckets`, set here)."""
        self.buckets = Buckets(units(self.cfg), {n: self.params[n].shape for n in self.names}, self.groups["dp"])
        return FlatAdamW(self, self.buckets)

    def gathered(self, buckets, name: Op) -> list:
        """The full padded flat weights of these units, gathered from every worker's slice and counted alive until
        Python frees them."""
        flats = [self.buckets.gather(self.mine, b, name) for b in buckets]
        for f in flats:
            self.alive += nbytes(f)
            weakref.finalize(f, self._freed, nbytes(f))
        self.peak = max(self.peak, self.alive)
        return flats

    def _freed(self, n: int) -> None:
        self.alive -= n

    def weights_of(self, buckets, flats) -> dict:
        return {n: t for b, f in zip(buckets, flats) for n, t in self.buckets.unpack(b, f).items()}

    def train_step(self, micro_batches: list) -> dict:
        parts, count = self.batch(micro_batches)
        level = self.layout.opt_level
        acc, loss = None, 0.0
        for tokens, labels, mask in parts:
            step = self.recomputed if level == 3 else self.whole
            value, grads = step(tokens, labels, mask, count)  # level1: full flat buffers; level2/3: a slice
            loss += value
            if level == 1:
                acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
            else:
                acc = grads if acc is None else acc + grads
        self.held_grads = sum(nbytes(a) for a in acc) if level == 1 else nbytes(acc)
        g = self.buckets.scatter(acc, Op.OPT_REDUCE_SCATTER) if level == 1 else acc
        loss = sum_over(self.groups["dp"], loss, Op.LOSS)
        self.mine, norm = self.optimizer.update(self.mine, g)
        return {"loss": loss, "grad_norm": norm}

    def whole(self, tokens, labels, mask, count):
        """Levels 1 and 2: every unit gathered, one forward and backward with them; (loss, full gradient buffers)
        at level1, (loss, this worker's reduce-scattered gradient slice) at level2."""
        import mindspore as ms

        every = range(len(self.buckets.flats))
        flats = self.gathered(every, Op.OPT_ALL_GATHER)
        value, grads = ms.value_and_grad(lambda *fl: self.loss(self.weights_of(every, fl), tokens, labels, mask,
                                                                count), grad_position=tuple(every))(*flats)
        del flats  # released once the backward is done
        grads = list(grads)
        return float(value.asnumpy()), grads if self.layout.opt_level == 1 else self.buckets.scatter(
            grads, Op.OPT_REDUCE_SCATTER)

    def segments(self, labels, mask, count) -> list:
        """`scratch.stage` and the loss cut at the units: (units read, f(weights, x) -> x) in forward order."""
        cfg = self.cfg
        frame = scratch.Frame(*scratch.rope_tables(cfg, mask.shape[1]), scratch.mask_adder(mask))
        last = len(self.buckets.flats) - 1
        head = [last] + ([0] if cfg.tie_word_embeddings else [])

        def layer(i):
            return lambda p, x: scratch.layer(p, i, x, cfg, self.shard, self.hooks, frame)

        return ([([0], lambda p, x: scratch.embed(p, x, self.hooks, self.shard))]
                + [([1 + i], layer(i)) for i in range(cfg.num_layers)]
                + [(head, lambda p, x: scratch.loss_terms(scratch.head(p, x, cfg, self.hooks), labels, mask,
                                                          self.hooks)[0] / count)])

    def recomputed(self, tokens, labels, mask, count):
        """Level 3: the forward unit by unit (gather, compute, release: no autodiff, so nothing of the gathered
        weights stays), keeping each unit's input; the backward from the last unit, each gathered again and
        recomputed under `ms.vjp`, its weight gradients reduce-scattered at once. (loss, gradient slice)."""
        import mindspore as ms
        from mindspore import ops

        segments, inputs, x = self.segments(labels, mask, count), [], tokens
        for reads, f in segments:
            inputs.append(x)
            flats = self.gathered(reads, Op.OPT_ALL_GATHER)
            x = f(self.weights_of(reads, flats), x)
            del flats
        loss, dx = float(x.asnumpy()), ms.Tensor(1.0, x.dtype)
        slices = [None] * len(self.buckets.flats)
        for k in reversed(range(len(segments))):
            (reads, f), x = segments[k], inputs.pop()
            flats = self.gathered(reads, Op.OPT_REGATHER)
            if k:  # a unit after the embedding: gradients of its input and its weights
                _, vjp = ms.vjp(lambda x_, *fl: f(self.weights_of(reads, fl), x_), x, *flats)
                dx, *dw = vjp(dx)
            else:  # the embedding's input is token ids: its weights' gradient only
                _, vjp = ms.vjp(lambda *fl: f(self.weights_of(reads, fl), x), *flats)
                dw = vjp(dx)
                dw = list(dw) if isinstance(dw, tuple) else [dw]
            del flats, vjp
            for b, g in zip(reads, dw):
                part = self.buckets.scatter([g], Op.OPT_REDUCE_SCATTER)
                slices[b] = part if slices[b] is None else slices[b] + part
        return loss, ops.cat(slices)

    def bytes_held(self) -> Held:
        return Held(nbytes(self.mine), self.held_grads, self.optimizer.nbytes(), self.peak)

    def weights(self) -> dict:
        """The full final weights, gathered from every worker's slice (every worker must call this)."""
        every = range(len(self.buckets.flats))
        full = self.weights_of(every, [self.buckets.gather(self.mine, b, Op.OPT_GATHER_TO_SAVE) for b in every])
        return {n: full[n].asnumpy() for n in self.names}
