"""A Llama decoder written out from MindSpore primitives: the model the parallel layouts shard.

It reads and writes the parameter names of `mindformers.LlamaForCausalLM` (so it loads the lab's checkpoints and
gives the same logits) and computes, for a batch of token ids [b, s]:

    x = E[tokens]                                            embedding rows
    per layer:  x = x + Wo · attn(rope(Wq·n1(x)), rope(Wk·n1(x)), Wv·n1(x))     causal, grouped-query
                x = x + W2 · (silu(W1·n2(x)) * W3·n2(x))                        SwiGLU
    logits = H · norm(x)                                     H = E when the embeddings are tied

with n(x) = x / sqrt(mean(x²) + eps) * g (RMSNorm) and rope the rotate-half rotary embedding mindformers uses.

One worker may hold a part of it (`Shard`): a range of layers (a pipeline stage), and 1/tp of every attention head
group and FFN column (tensor parallel: wq/wk/wv and w1/w3 by output rows, wo and w2 by input columns). Where the
parts meet, the forward calls four hooks; on one card they are the identity, and labkit.byhand.tensor_parallel
supplies the collectives with their backward (labkit.byhand.mappings):

    block_in(h)   before a tensor-parallel block     TP: identity, backward all-reduce  SP: all-gather the sequence
    block_out(o)  after it (partial sums)            TP: all-reduce, backward identity  SP: reduce-scatter it
    seq_in(x)     after the embedding                SP: keep this worker's sequence chunk
    seq_out(x)    before the head                    SP: all-gather the sequence

With a vocabulary-parallel embedding and head (Megatron-LM's VocabParallelEmbedding and
vocab_parallel_cross_entropy; `Shard.vocab_parallel`), worker r of t also holds rows [r·V/t, (r+1)·V/t) of the
embedding table and of the head (the same rows of the one table when they are tied), and three more hooks join
the parts:

    embed_sum(e)            the masked partial lookups       forward all-reduce, backward identity
    head_in(h)              before the head's matmul          forward identity, backward all-reduce
    cross_entropy(z, y)     the loss from logit slices        labkit.byhand.tensor_parallel.vocab_parallel_cross_entropy

Under context parallelism a worker holds a part of every sequence, and two more hooks place it
(labkit.byhand.context_parallel):

    frame(cfg, mask)        what every layer reads (`Frame`)  RoPE at each token's global position, the masks
    attend(q, k, v, frame)  the attention core                ring attention, or Ulysses' all-to-alls around it
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labkit.config import ModelConfig
from labkit.errors import LabkitError

EMBED, NORM, HEAD = "model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight"
LAYER = "model.layers.{}."
ROW_SPLIT = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
             "feed_forward.w1.weight", "feed_forward.w3.weight")  # split by output rows (column parallel)
COL_SPLIT = ("attention.wo.weight", "feed_forward.w2.weight")  # split by input columns (row parallel)
LAYER_KEYS = ("attention_norm.weight", "ffn_norm.weight") + ROW_SPLIT + COL_SPLIT


@dataclass(frozen=True)
class Shard:
    """What one worker holds: layers [first_layer, end_layer), the embedding if `first`, the final norm and head if
    `last`, and the tp_rank-th of tp_size slices of every tensor-parallel weight."""
    first_layer: int = 0
    end_layer: int | None = None  # None: to the last layer
    tp_size: int = 1
    tp_rank: int = 0
    vocab_parallel: bool = False  # the embedding and the head split by vocabulary rows over tp too

    def layers(self, cfg: ModelConfig) -> range:
        return range(self.first_layer, cfg.num_layers if self.end_layer is None else self.end_layer)

    def first(self, cfg: ModelConfig) -> bool:
        return self.first_layer == 0

    def last(self, cfg: ModelConfig) -> bool:
        return self.layers(cfg).stop == cfg.num_layers

    def splits(self, name: str) -> bool:
        """Whether this shard holds a 1/tp_size slice of parameter `name` (else the whole of it)."""
        if self.tp_size == 1:
            return False
        return name.endswith(COL_SPLIT) or split_by_rows(name, self.vocab_parallel)


class Hooks:
    """One card: every hook is the identity, and the loss is the plain cross-entropy."""

    def block_in(self, h):
        return h

    def block_out(self, o):
        return o

    def seq_in(self, x):
        return x

    def seq_out(self, x):
        return x

    def embed_sum(self, e):
        return e

    def head_in(self, h):
        return h

    def cross_entropy(self, logits_, labels):
        """Per-token cross-entropy [n] of logits [n, vocab] and labels [n]."""
        from mindspore import ops

        return ops.cross_entropy(logits_, labels, reduction="none")

    def frame(self, cfg: ModelConfig, mask):
        """What every layer of one forward pass reads besides its input (`Frame`), from the batch's mask [b, s]."""
        return Frame(*rope_tables(cfg, mask.shape[1]), mask_adder(mask))

    def attend(self, q, k, v, frame):
        """The attention core over this worker's whole sequence: q [b, heads, s, d], k and v [b, kv heads, s, d]
        (RoPE applied) -> context [b, heads, s, d]."""
        return core_attention(q, k, v, frame.adder)


HOOKS = ("block_in", "block_out", "seq_in", "seq_out", "embed_sum", "head_in", "cross_entropy")  # tp's, sp's, vocab's


def check_shard(cfg: ModelConfig, shard: Shard) -> None:
    layers = shard.layers(cfg)
    if not 0 <= layers.start < layers.stop <= cfg.num_layers:
        raise LabkitError(f"layers {layers.start}..{layers.stop - 1} are not inside the model's {cfg.num_layers}",
                          "give each pipeline stage at least one layer")
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads),
                    ("intermediate_size", cfg.ffn_size)):
        if n % shard.tp_size:
            raise LabkitError(f"tensor parallel {shard.tp_size} does not divide {name} {n}",
                              "choose a tensor-parallel size that divides the heads, the kv heads and the FFN width")
    if shard.vocab_parallel and cfg.vocab_size % shard.tp_size:
        raise LabkitError(f"tensor parallel {shard.tp_size} does not divide vocab_size {cfg.vocab_size}",
                          "pad the vocabulary to a multiple of the tensor-parallel size, or keep the head whole")


def names(cfg: ModelConfig, shard: Shard = Shard()) -> list[str]:
    """The parameter names this shard holds, in mindformers' naming."""
    out = [EMBED] if shard.first(cfg) else []
    for i in shard.layers(cfg):
        out += [LAYER.format(i) + k for k in LAYER_KEYS]
    if shard.last(cfg):
        out.append(NORM)
        if not cfg.tie_word_embeddings:
            out.append(HEAD)
        elif not shard.first(cfg):
            raise LabkitError("a tied head needs the embedding on the last stage", "untie it, or use one stage")
    return out


def split_by_rows(name: str, vocab_parallel: bool) -> bool:
    """Whether tensor parallelism splits parameter `name` by rows: the column-parallel matrices, and the embedding and
    the head when they are vocabulary-parallel."""
    return name.endswith(ROW_SPLIT) or vocab_parallel and name in (EMBED, HEAD)


def shard_array(name: str, full: np.ndarray, shard: Shard) -> np.ndarray:
    """This worker's slice of one full parameter."""
    n, r = shard.tp_size, shard.tp_rank
    if split_by_rows(name, shard.vocab_parallel):
        k = full.shape[0] // n
        return full[r * k:(r + 1) * k]
    if name.endswith(COL_SPLIT):
        k = full.shape[1] // n
        return full[:, r * k:(r + 1) * k]
    return full


def unshard(name: str, parts: list[np.ndarray], vocab_parallel: bool = False) -> np.ndarray:
    """The full parameter from every tp rank's slice (in rank order)."""
    if split_by_rows(name, vocab_parallel):
        return np.concatenate(parts, axis=0)
    if name.endswith(COL_SPLIT):
        return np.concatenate(parts, axis=1)
    return parts[0]


def parameters(full: dict, cfg: ModelConfig, shard: Shard = Shard(), dtype=np.float32) -> dict:
    """`ms.Parameter`s (named as mindformers does) for this shard, from full numpy arrays."""
    import mindspore as ms

    check_shard(cfg, shard)
    missing = [n for n in names(cfg, shard) if n not in full]
    if missing:
        raise LabkitError(f"the weights lack {len(missing)} parameter(s) the model needs, e.g. {missing[0]}",
                          "give weights of the same model configuration (mindformers names)")
    return {n: ms.Parameter(ms.Tensor(np.ascontiguousarray(shard_array(n, full[n], shard), dtype)), name=n)
            for n in names(cfg, shard)}


def rope_tables(cfg: ModelConfig, seq_len: int):
    """cos and sin [seq_len, head_dim] of the rotate-half rotary embedding (as mindformers' FreqsMgr builds them)."""
    import mindspore as ms

    d = cfg.hidden_size // cfg.num_heads
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2)[: d // 2].astype(np.float32) / d))
    angles = np.outer(np.arange(seq_len, dtype=np.float32), freqs)
    emb = np.concatenate([angles, angles], axis=-1)
    return ms.Tensor(np.cos(emb).astype(np.float32)), ms.Tensor(np.sin(emb).astype(np.float32))


def rms_norm(x, g, eps: float):
    from mindspore import ops

    return x * ops.rsqrt(ops.mean(ops.square(x), -1, keep_dims=True) + eps) * g


def rope(x, cos, sin):
    """x [b, heads, s, d]: x·cos + rotate_half(x)·sin, rotate_half([x1, x2]) = [-x2, x1]."""
    from mindspore import ops

    half = x.shape[-1] // 2
    rotated = ops.cat([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Frame:
    """What every layer of one forward pass reads besides its input: the RoPE tables of the sequence length and
    the batch's additive attention mask."""

    cos: object
    sin: object
    adder: object  # [b, 1, s, s], mask_adder


def attention(p: dict, pre: str, h, cfg: ModelConfig, shard: Shard, frame: Frame, hooks: Hooks = Hooks()):
    """Causal grouped-query attention over the heads this worker holds; returns wo's (partial, under TP) output."""
    from mindspore import ops

    b, s, _ = h.shape
    d = cfg.hidden_size // cfg.num_heads
    heads, kv = cfg.num_heads // shard.tp_size, cfg.kv_heads // shard.tp_size
    split = lambda t, n: ops.transpose(ops.reshape(t, (b, s, n, d)), (0, 2, 1, 3))  # noqa: E731
    q = rope(split(ops.matmul(h, p[pre + "attention.wq.weight"].T), heads), frame.cos, frame.sin)
    k = rope(split(ops.matmul(h, p[pre + "attention.wk.weight"].T), kv), frame.cos, frame.sin)
    v = split(ops.matmul(h, p[pre + "attention.wv.weight"].T), kv)
    ctx = hooks.attend(q, k, v, frame)
    ctx = ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (b, s, heads * d))
    return ops.matmul(ctx, p[pre + "attention.wo.weight"].T)


def grouped(k, heads: int):
    """Key or value heads [b, kv, s, d] repeated for `heads` query heads: each group of heads // kv query heads
    reads one key/value head (grouped-query attention)."""
    from mindspore import ops

    kv = k.shape[1]
    return k if heads == kv else ops.repeat_interleave(k, heads // kv, 1)


def core_attention(q, k, v, adder):
    """softmax(q·kᵀ/sqrt(d) + adder)·v per head: q [b, heads, s, d], k and v [b, kv, t, d], adder [b, 1, s, t]."""
    from mindspore import ops

    heads, d = q.shape[1], q.shape[-1]
    k, v = grouped(k, heads), grouped(v, heads)
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(d))
    scores = scores + adder
    return ops.matmul(ops.softmax(scores, axis=-1), v)


MASKED = -10000.0  # what mindformers adds to a masked score (a row with every key masked becomes uniform)


def mask_adder(mask):
    """[b, 1, s, s] added to the scores: query i sees key j <= i unless j is padding (mask [b, s], 1 = token)."""
    import mindspore as ms
    from mindspore import ops

    s = mask.shape[1]
    lower = ms.Tensor(np.tril(np.ones((s, s), np.float32)))
    return (1.0 - ops.expand_dims(ops.expand_dims(mask, 1), 1) * lower) * MASKED


def mlp(p: dict, pre: str, h):
    """SwiGLU over the FFN columns this worker holds; returns w2's (partial, under TP) output."""
    from mindspore import ops

    gate = ops.silu(ops.matmul(h, p[pre + "feed_forward.w1.weight"].T))
    return ops.matmul(gate * ops.matmul(h, p[pre + "feed_forward.w3.weight"].T), p[pre + "feed_forward.w2.weight"].T)


def layer(p: dict, i: int, x, cfg: ModelConfig, shard: Shard, hooks: Hooks, frame: Frame):
    """One decoder layer. `x` is the residual stream (sequence-sharded under SP)."""
    pre = LAYER.format(i)
    h = hooks.block_in(rms_norm(x, p[pre + "attention_norm.weight"], cfg.rms_norm_eps))
    x = x + hooks.block_out(attention(p, pre, h, cfg, shard, frame, hooks))
    h = hooks.block_in(rms_norm(x, p[pre + "ffn_norm.weight"], cfg.rms_norm_eps))
    return x + hooks.block_out(mlp(p, pre, h))


def embed(p: dict, tokens, hooks: Hooks = Hooks(), shard: Shard = Shard()):
    """The embedding rows of the tokens. Vocabulary-parallel: this worker's table holds rows [lo, lo + rows); a
    token outside them looks up zeros, and `hooks.embed_sum` adds the workers' partial lookups."""
    from mindspore import ops

    table = p[EMBED]
    if not shard.vocab_parallel or shard.tp_size == 1:
        return hooks.seq_in(ops.gather(table, tokens, 0))
    rows = table.shape[0]
    local = tokens - shard.tp_rank * rows
    inside = ops.logical_and(local >= 0, local < rows)
    found = ops.gather(table, ops.where(inside, local, ops.zeros_like(local)), 0)
    return hooks.seq_in(hooks.embed_sum(found * ops.expand_dims(inside.astype(found.dtype), -1)))


def head(p: dict, x, cfg: ModelConfig, hooks: Hooks = Hooks()):
    """Logits [b, s, rows of the head this worker holds] (every row on one card)."""
    from mindspore import ops

    h = hooks.head_in(rms_norm(hooks.seq_out(x), p[NORM], cfg.rms_norm_eps))
    return ops.matmul(h, p[EMBED if cfg.tie_word_embeddings else HEAD].T)


def stage(p: dict, x, mask, cfg: ModelConfig, shard: Shard = Shard(), hooks: Hooks = Hooks()):
    """This shard's part of the forward: token ids [b, s] in on the first stage, logits out of the last one, the
    residual stream [b, s, h] (sequence-sharded under SP) in between. `mask` [b, s]: 1 where the input is a token,
    0 where it is padding (every stage has it: it comes with the batch; under context parallelism the whole rows'
    mask, while x holds this worker's part of the sequence)."""
    if shard.first(cfg):
        x = embed(p, x, hooks, shard)
    frame = hooks.frame(cfg, mask)
    for i in shard.layers(cfg):
        x = layer(p, i, x, cfg, shard, hooks, frame)
    return head(p, x, cfg, hooks) if shard.last(cfg) else x


def logits(p: dict, tokens, cfg: ModelConfig, pad_token_id: int | None = None):
    """The whole model on one card: token ids [b, s] -> logits [b, s, vocab]."""
    import mindspore as ms

    pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
    mask = ms.Tensor((np.asarray(tokens.asnumpy() if hasattr(tokens, "asnumpy") else tokens) != pad)
                     .astype(np.float32))
    return stage(p, tokens, mask, cfg)


def loss_terms(logits_, labels, mask, hooks: Hooks = Hooks()):
    """(sum of masked token cross-entropies, number of counted tokens): the loss is their ratio, as mindformers
    computes it (mask = inputs that are not padding). Kept as two terms so that a layout that splits the batch can
    sum both over its workers before dividing. `logits_` may be this worker's vocabulary slice: `hooks` then
    computes the cross-entropy from the slices."""
    from mindspore import ops

    v = logits_.shape[-1]
    ce = hooks.cross_entropy(ops.reshape(logits_, (-1, v)), ops.reshape(labels, (-1,)))
    return ops.sum(ce * ops.reshape(mask, (-1,))), ops.sum(mask)


def split_batch(ids, pad_token_id: int):
    """Token ids [b, s+1] -> (inputs [b, s], labels [b, s], mask [b, s]) as LlamaForCausalLM splits them."""
    import mindspore as ms

    ids = np.asarray(ids, np.int32)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    mask = (tokens != pad_token_id).astype(np.float32)
    return ms.Tensor(tokens), ms.Tensor(labels), ms.Tensor(mask)


def init(cfg: ModelConfig, seed: int) -> dict:
    """Full float32 weights drawn as `labkit.model.llama.init_weights` draws them for the mindformers model (names
    sorted, one generator): Normal(0, init_std), the residual-branch outputs scaled by 1/sqrt(2 * num_layers),
    norm gains 1. The same seed gives the same numbers in both models."""
    rng = np.random.default_rng(seed)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scale_residual_init else cfg.init_std
    out = {}
    for name, shape in sorted(shapes(cfg).items()):
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            std = out_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else cfg.init_std
            out[name] = rng.normal(0.0, std, size=shape).astype(np.float32)
    return out


def shapes(cfg: ModelConfig) -> dict:
    """Every parameter's full shape, by name."""
    h, d, f = cfg.hidden_size, cfg.hidden_size // cfg.num_heads, cfg.ffn_size
    per = {"attention_norm.weight": (h,), "ffn_norm.weight": (h,), "attention.wq.weight": (h, h),
           "attention.wk.weight": (cfg.kv_heads * d, h), "attention.wv.weight": (cfg.kv_heads * d, h),
           "attention.wo.weight": (h, h), "feed_forward.w1.weight": (f, h), "feed_forward.w3.weight": (f, h),
           "feed_forward.w2.weight": (h, f)}
    out = {EMBED: (cfg.vocab_size, h), NORM: (h,)}
    if not cfg.tie_word_embeddings:
        out[HEAD] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        out.update({LAYER.format(i) + k: v for k, v in per.items()})
    return out


def mindformers_weights(model) -> dict:
    """{name: float32 array} of a mindformers Llama (what `parameters` takes)."""
    return {p.name: p.asnumpy().astype(np.float32) for p in model.get_parameters()}
