"""Context parallelism by hand: the cp workers of a group each hold a part of every sequence of their batch, and
attention, the one operation that mixes positions, is computed across them: ring attention (Liu et al. 2023,
"Ring Attention with Blockwise Transformers") or DeepSpeed-Ulysses (Jacobs et al. 2023). mindformers 1.9 sets the
degree with `parallel_config.context_parallel` and the algorithm with `context_parallel_algo` (colossalai_cp,
ulysses_cp or hybrid_cp); its key/value ring is the model's `use_ring_attention: True` (with flash attention).
MindSpore refuses them on CPU, so here they are written out.

The split. With cp workers the s tokens of a sequence are cut into 2·cp chunks of c = s / (2·cp). Under the causal
mask query chunk a reads key chunks 0..a, so a contiguous split (worker r: chunks 2r and 2r+1, "naive") leaves
worker 0 three chunk pairs to compute and worker cp-1 4·cp-1. The balanced split ("zigzag", as Megatron-LM's
context parallel and picotron cut the sequence) gives worker r chunks r and 2·cp-1-r: every worker 2·cp+1 pairs
(`work` counts them). Brandon et al. 2023 (striped attention) balance the same way with a token-level stripe.
In the ring the balance must hold step by step: every worker waits at each pass for the slowest before the blocks
move on, so a worker idles, per step, the busiest worker's work minus its own (`ring_units`, `idle_units`; the
score elements the causal mask leaves, c² below the diagonal and c(c+1)/2 on it). Zigzag gives every worker 2c²
at every step after the first; the contiguous split gives 4c² to a worker holding an earlier worker's block and
nothing to one holding a later worker's.
A worker's tokens keep their global positions: RoPE is applied at them, and the masks are the whole sequence's
restricted to the blocks (`ContextParallel.frame`; every cp worker reads the whole rows of its batch, so the
padding of every chunk is known without communication).

Online softmax (Milakov and Gimelshein 2018; flash attention's rule): for query rows and key blocks j with scores
S_j (masked entries -10000, `scratch.MASKED`), keep the running maximum m, sum l and output o:

    m' = max(m, rowmax S_j)    l' = l·exp(m - m') + rowsum exp(S_j - m')    o' = o·exp(m - m') + exp(S_j - m')·V_j

and at the end o / l is softmax over every block times V. m is a shift that cancels in o / l: it carries no
gradient (stop_gradient). A key chunk after the query chunk is wholly in the future: its scores are all masked
and exp(-10000 - m) is 0 in float32, so it is skipped (`pairs`) without changing the result, but for a row that
sees no key at all (a sequence beginning with padding): the full softmax averages every key there, the blocks the
computed keys only; such a row is padding, and no token's loss reads its output.

Ring attention: a worker keeps its query chunks and its key/value [2, b, kv heads, 2c, d] (grouped-query: the
kv heads only, before they are repeated for the query heads); cp - 1 times it passes the key/value block it holds
to the next worker and receives the previous one's (`mappings.ring_pass`), merging each into its running state.
Backward, each block's gradient goes back the way the block came (autodiff through the passes: the gradient of
the block received at step t returns, summed with the gradients of the steps before, to its owner). Real ring
attention overlaps each pass with the block's compute; with no Send/Receive on CPU a pass is an all-reduce
(`comm.Group.shift`), counted as sent beside what the point-to-point ring sends: per layer and worker (cp - 1)
blocks of 2·b·(s/cp)·kv·d values forward, (cp-1)/cp of the sequence's key/value, and the same in gradients back.

Ulysses: before attention, an all-to-all of q, k and v trades the sequence split for a head split (each worker all
tokens, heads/cp of the heads), full causal attention over its heads (the sequence in group order, the mask
permuted to match), and one all-to-all of the context back (`mappings.seq_to_heads`, `heads_to_seq`): 4
all-to-alls per layer forward, their 4 reverses backward, each sending (cp-1)/cp of this worker's tensor. Every
worker needs whole heads and whole kv heads: cp must divide both (`check_ulysses`), which grouped-query attention's
few kv heads limit first; the ring has no such limit."""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from labkit.byhand.comm import Group, chunk
from labkit.byhand.mappings import TOKENS, heads_to_seq, ring_pass, seq_to_heads
from labkit.errors import LabkitError
from labkit.model.scratch import HOOKS, Frame, Hooks, core_attention, grouped, mask_adder, rope_tables

ALGOS = ("ring", "ulysses")  # HandLayout.cp_algo; mindformers: use_ring_attention, context_parallel_algo ulysses_cp


def chunks_of(cp: int, rank: int, balanced: bool = True) -> tuple[int, int]:
    """The two of 2·cp sequence chunks worker `rank` holds: (r, 2·cp-1-r) balanced, (2r, 2r+1) contiguous."""
    return (rank, 2 * cp - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def chunk_len(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise LabkitError(f"a sequence of {seq_len} tokens does not cut into 2 x context parallel {cp} chunks",
                          f"choose seq_len a multiple of {2 * cp} (2 x context_parallel)")
    return seq_len // (2 * cp)


def positions(seq_len: int, cp: int, rank: int, balanced: bool = True) -> np.ndarray:
    """The global positions of worker `rank`'s tokens, in the order it holds them."""
    c = chunk_len(seq_len, cp)
    return np.concatenate([np.arange(a * c, (a + 1) * c) for a in chunks_of(cp, rank, balanced)])


def pairs(q_chunks, k_chunks) -> list[tuple[int, int, int, int]]:
    """(i, j, a, b): the query chunk a (i-th held) and key chunk b (j-th) whose block is computed: b <= a (the
    rest is wholly in the future under the causal mask)."""
    return [(i, j, a, b) for i, a in enumerate(q_chunks) for j, b in enumerate(k_chunks) if b <= a]


def work(cp: int, balanced: bool = True) -> list[int]:
    """Per worker, the query-key chunk pairs it computes over a whole sequence of 2·cp chunks (each c x c scores):
    balanced 2·cp+1 each; contiguous 4r+3 for worker r."""
    return [len(pairs(chunks_of(cp, r, balanced), range(2 * cp))) for r in range(cp)]


def pair_units(a: int, b: int, c: int) -> int:
    """Score elements query chunk a computes against key chunk b (c tokens each) under the causal mask, per
    sequence and head: c² for a key chunk before it, c(c+1)/2 on the diagonal, none after it."""
    return c * c if b < a else c * (c + 1) // 2 if b == a else 0


def ring_units(cp: int, c: int, balanced: bool = True) -> list[list[int]]:
    """[ring step][worker] the score elements (per sequence and head) worker r computes at step t: its query chunks
    against the key/value block of worker (r - t) mod cp, the one it holds at that step."""
    return [[sum(pair_units(a, b, c) for _, _, a, b in pairs(chunks_of(cp, r, balanced),
                                                             chunks_of(cp, (r - t) % cp, balanced)))
             for r in range(cp)] for t in range(cp)]


def idle_units(per_step) -> list:
    """Per worker, the work it waits for: at each ring step the busiest worker's work minus its own
    (`per_step` [step][worker], as `ring_units` or a run's records)."""
    return [sum(max(step) - step[r] for step in per_step) for r in range(len(per_step[0]))]


class RingStep(NamedTuple):
    """One ring step of one worker over a run (every layer and micro-batch): the score elements it computed (the
    causal mask's unmasked ones, every sequence and head) and the forward pass's wall time spent computing them."""
    units: int
    seconds: float


def take(x, axis: int, cp: int, rank: int, balanced: bool = True):
    """Worker `rank`'s chunks of x (the whole sequence along `axis`), one after the other."""
    from mindspore import ops

    return ops.cat([chunk(x, axis, 2 * cp, a) for a in chunks_of(cp, rank, balanced)], axis)


def check_ulysses(heads: int, kv_heads: int, cp: int, where: str = "") -> None:
    """Ulysses gives each worker whole heads: cp must divide the query heads and the key/value heads a worker
    holds (per tensor-parallel worker)."""
    for key, n in (("num_heads", heads), ("num_kv_heads", kv_heads)):
        if n % cp:
            raise LabkitError(f"{where}Ulysses context parallel {cp} does not divide {key} {n} (the heads of one "
                              "tensor-parallel worker)",
                              "choose cp dividing num_heads and num_kv_heads per tp worker (grouped-query "
                              "attention's few kv heads are the limit), or cp_algo 'ring', which splits the "
                              "sequence only")


def merge(state, q, k, v, adder):
    """The running (o, m, l) of query rows q [b, h, c, d] after one more key block k, v [b, kv, c', d] (adder
    [b, 1, c, c']): the online-softmax rule of the module docstring. state None: the first block."""
    import math

    from mindspore import ops

    heads, d = q.shape[1], q.shape[-1]
    k, v = grouped(k, heads), grouped(v, heads)
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(d)) + adder
    top = ops.stop_gradient(ops.amax(scores, -1, keepdims=True))
    if state is None:
        e = ops.exp(scores - top)
        return ops.matmul(e, v), top, e.sum(-1, keepdims=True)
    o, m, total = state
    m2 = ops.maximum(m, top)
    e, old = ops.exp(scores - m2), ops.exp(m - m2)
    return o * old + ops.matmul(e, v), m2, total * old + e.sum(-1, keepdims=True)


def attend_blocks(q, q_chunks, blocks, adders: dict, record: list | None = None):
    """Attention of one worker's queries q [b, h, n·c, d] (its chunks `q_chunks`, c tokens each) over key/value
    blocks (k, v, their chunks), merged by the online softmax; `adders[(a, b)]` [b, 1, c, c] is the mask of query
    chunk a against key chunk b. Returns the context [b, h, n·c, d]. `record` ([units, seconds] per block, in
    arrival order): each block's score elements computed and the time computing them took added in."""
    import mindspore as ms
    from mindspore import ops

    c = q.shape[TOKENS] // len(q_chunks)
    state = [None] * len(q_chunks)
    for step, (k, v, k_chunks) in enumerate(blocks):
        t0, units = time.perf_counter(), 0  # after the block arrived: the pass is not timed
        for i, j, a, b in pairs(q_chunks, k_chunks):
            piece = lambda t, n: chunk(t, TOKENS, t.shape[TOKENS] // c, n)  # noqa: E731
            state[i] = merge(state[i], piece(q, i), piece(k, j), piece(v, j), adders[(a, b)])
            units += q.shape[0] * q.shape[1] * pair_units(a, b, c)
        if record is not None:
            ms.runtime.synchronize()  # PyNative launches asynchronously: wait for the block's kernels
            record[step][0] += units
            record[step][1] += time.perf_counter() - t0
    return ops.cat([o / total for o, _, total in state], TOKENS)


def block_adders(full: np.ndarray, q_chunks, c: int) -> dict:
    """{(a, b): mask of query chunk a against key chunk b} from the whole sequence's [b, 1, s, s] (numpy), for
    every block a worker holding `q_chunks` computes."""
    import mindspore as ms

    every = range(full.shape[-1] // c)
    return {(a, b): ms.Tensor(np.ascontiguousarray(full[:, :, a * c:(a + 1) * c, b * c:(b + 1) * c]))
            for _, _, a, b in pairs(q_chunks, every)}


def split_attention(q, k, v, mask, cp: int, balanced: bool = True):
    """Causal attention over whole sequences (q [b, h, s, d], k and v [b, kv, s, d], mask [b, s]) computed as cp
    workers would, in one process: each worker's query chunks against every worker's key/value blocks, merged by
    the online softmax; the chunks put back in order. Equals `scratch.core_attention` with `mask_adder(mask)`."""
    from mindspore import ops

    s = q.shape[TOKENS]
    c, full = chunk_len(s, cp), mask_adder(mask).asnumpy()
    out = [None] * (2 * cp)
    for r in range(cp):
        mine = chunks_of(cp, r, balanced)
        blocks = [(take(k, TOKENS, cp, j, balanced), take(v, TOKENS, cp, j, balanced), chunks_of(cp, j, balanced))
                  for j in range(cp)]
        ctx = attend_blocks(take(q, TOKENS, cp, r, balanced), mine, blocks, block_adders(full, mine, c))
        for i, a in enumerate(mine):
            out[a] = chunk(ctx, TOKENS, 2, i)
    return ops.cat(out, TOKENS)


class ContextParallel(Hooks):
    """The model's hooks (labkit.model.scratch.Hooks) for context parallelism over `group` with `algo` ("ring" or
    "ulysses"), the other hooks those of `inner` (one card's, or tensor parallel's: the heads split by tp first,
    then by Ulysses' degree). `take` cuts this worker's part out of a whole sequence; `frame` and `attend` place
    it. `balanced` False: the contiguous split (to show its imbalance; the ring's backward needs the balanced one,
    where every received block is read)."""

    def __init__(self, group: Group, algo: str = "ring", inner: Hooks | None = None, balanced: bool = True):
        if algo not in ALGOS:
            raise LabkitError(f"context parallel algorithm '{algo}' is not known", f"use one of {', '.join(ALGOS)}")
        inner = inner or Hooks()
        for name in HOOKS:
            setattr(self, name, getattr(inner, name))
        self.group, self.algo, self.balanced = group, algo, balanced
        self.chunks = chunks_of(group.size, group.index, balanced)
        if algo == "ring":
            self.pass_on = ring_pass(group)
            self.record = [[0, 0.0] for _ in range(group.size)]  # per ring step: units and seconds, summed
        else:
            self.to_heads, self.to_seq = seq_to_heads(group), heads_to_seq(group)

    def take(self, x, axis: int = 1):
        """This worker's chunks of x [b, s, ...] (or of any axis holding the whole sequence)."""
        return take(x, axis, self.group.size, self.group.index, self.balanced)

    def frame(self, cfg, mask):
        """From the whole rows' mask [b, s]: RoPE tables at this worker's global positions; the ring's mask per
        block it computes ({(a, b): [b, 1, c, c]}), or Ulysses' [b, 1, s, s] over the sequence in group order."""
        import mindspore as ms
        from mindspore import ops

        s, cp = mask.shape[1], self.group.size
        c, full = chunk_len(s, cp), mask_adder(mask).asnumpy()
        where = ms.Tensor(positions(s, cp, self.group.index, self.balanced), ms.int32)
        cos, sin = (ops.gather(t, where, 0) for t in rope_tables(cfg, s))
        if self.algo == "ring":
            return Frame(cos, sin, block_adders(full, self.chunks, c))
        order = np.concatenate([positions(s, cp, r, self.balanced) for r in range(cp)])
        return Frame(cos, sin, ms.Tensor(np.ascontiguousarray(full[:, :, order][:, :, :, order])))

    def attend(self, q, k, v, frame):
        """This worker's context [b, heads, its tokens, d] from its q, k, v (RoPE applied)."""
        if self.algo == "ulysses":
            check_ulysses(q.shape[1], k.shape[1], self.group.size)
            return self.to_seq(core_attention(self.to_heads(q), self.to_heads(k), self.to_heads(v), frame.adder))
        return attend_blocks(q, self.chunks, self.ring(k, v), frame.adder, self.record)

    def ring_steps(self) -> tuple[RingStep, ...]:
        """What this worker computed at each ring step so far (every layer and micro-batch), and how long it took."""
        return tuple(RingStep(*r) for r in self.record) if self.algo == "ring" else ()

    def ring(self, k, v):
        """The key/value blocks in the order they arrive: this worker's own, then cp - 1 passes around the ring
        (at step t the block of the worker t places before this one), each with its chunks."""
        from mindspore import ops

        cp, r = self.group.size, self.group.index
        kv = ops.stack([k, v])  # one pass carries both
        for t in range(cp):
            if t:
                kv = self.pass_on(kv)
            yield kv[0], kv[1], chunks_of(cp, (r - t) % cp, self.balanced)
