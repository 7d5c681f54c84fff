"""The lab's C++ RMSNorm, SwiGLU, RoPE, attention-softmax and cross-entropy operators equal mindformers' native cells
(values and gradients), its AdamW equals MindSpore's AdamWeightDecay, their build cache is keyed by the CPU, and a
machine without a compiler falls back to the native cells with one notice."""
from __future__ import annotations

import numpy as np
import pytest

from labkit.model.kernels import build as kbuild

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C++ compiler on this machine")

# float32 tolerance: both paths sum H = 256 squares and, for dw, 1024 rows in different orders; float32 rounding of
# a sum of n terms grows like sqrt(n) * 6e-8 relative (~2e-6 at n = 1024). 1e-5 of the largest value leaves margin
# and is still 1000x below a real error such as an eps dropped from the denominator (checked below).
RTOL = 1e-5


def pair(hidden=256, layers=4, eps=1e-5, seed=0):
    import mindspore as ms
    from mindspore import nn

    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    from mindformers.models.llama.llama_layer import LlamaRMSNorm

    class Stack(nn.Cell):  # several norms in a row, as in a decoder, scaled so each sees a fresh distribution
        def __init__(self):
            super().__init__()
            self.norms = nn.CellList([LlamaRMSNorm(hidden, eps, fused_kernel=False) for _ in range(layers)])

        def construct(self, x):
            for norm in self.norms:
                x = norm(x) * 1.5 + 0.1
            return x

    rng = np.random.default_rng(seed)
    native, custom = Stack(), Stack()
    for p, q in zip(native.trainable_params(), custom.trainable_params()):
        w = rng.normal(1.0, 0.2, p.shape).astype(np.float32)
        p.set_data(ms.Tensor(w))
        q.set_data(ms.Tensor(w.copy()))
    return native, custom


def value_and_grads(net, x, dy):
    import mindspore as ms

    def loss(x):
        return (net(x) * dy).sum()

    f = ms.jit(ms.value_and_grad(loss, 0, net.trainable_params()))
    value, (dx, dws) = f(x)
    return net(x).asnumpy(), float(value.asnumpy()), dx.asnumpy(), [g.asnumpy() for g in dws]


def close(a, b):
    return float(np.abs(a - b).max()) <= RTOL * float(np.abs(a).max())


def test_custom_rmsnorm_equals_native_values_and_gradients():
    import mindspore as ms

    from labkit.model.kernels.rmsnorm import use_custom_rms_norm

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    native, custom = pair()
    assert use_custom_rms_norm(custom) == 4
    names = [p.name for p in custom.trainable_params()]
    assert names == [p.name for p in native.trainable_params()], "the switch keeps the same parameters"
    rng = np.random.default_rng(1)
    x = ms.Tensor(rng.normal(0, 3, (4, 256, 256)).astype(np.float32))
    dy = ms.Tensor(rng.normal(0, 1, (4, 256, 256)).astype(np.float32))
    yn, ln, dxn, dwn = value_and_grads(native, x, dy)
    yc, lc, dxc, dwc = value_and_grads(custom, x, dy)
    assert close(yn, yc) and lc == pytest.approx(ln, rel=RTOL)
    assert close(dxn, dxc)
    assert all(close(a, b) for a, b in zip(dwn, dwc))
    # the tolerance can fail: the same comparison against a norm without eps in its denominator
    # (a plausible kernel bug) is far outside it on inputs with small rows
    small = ms.Tensor(rng.normal(0, 1e-3, (2, 8, 256)).astype(np.float32))
    no_eps, _ = pair(eps=1e-12)
    use_custom_rms_norm(no_eps)
    assert not close(native(small).asnumpy(), no_eps(small).asnumpy())


def test_cache_is_keyed_by_cpu_compiler_and_source(tmp_path, monkeypatch):
    lib = kbuild.build("rmsnorm", cache=tmp_path)
    assert lib.is_file() and lib.parent.parent == tmp_path
    assert kbuild.build("rmsnorm", cache=tmp_path) == lib, "a second call reuses the binary"
    assert "-march=native" in (lib.parent / "built_for.txt").read_text()
    cxx = kbuild.compiler()
    key = kbuild.cache_key(kbuild.SOURCES / "rmsnorm.cc", cxx)
    monkeypatch.setattr(kbuild, "cpu_identity", lambda: "another CPU\nflags: sse2 avx2")
    assert kbuild.cache_key(kbuild.SOURCES / "rmsnorm.cc", cxx) != key, "another CPU never reuses this binary"


def test_cache_key_covers_the_headers_the_kernels_include(tmp_path, monkeypatch):
    """swiglu.cc and xent.cc include fast_exp.h: editing it is a new key and a new build, never the stale binary.
    Done on a copy of the sources (SOURCES monkeypatched), so the real files are never touched."""
    import shutil

    from labkit.errors import LabkitFailure

    src = tmp_path / "src"
    shutil.copytree(kbuild.SOURCES, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    assert (src / "fast_exp.h").is_file() and '#include "fast_exp.h"' in (src / "swiglu.cc").read_text()
    monkeypatch.setattr(kbuild, "SOURCES", src)
    cxx = kbuild.compiler()
    key = kbuild.cache_key(src / "swiglu.cc", cxx)
    assert key == kbuild.cache_key(kbuild.SOURCES / "swiglu.cc", cxx)
    lib = kbuild.build("swiglu", cache=tmp_path / "cache")
    assert lib.parent.name == key
    header = (src / "fast_exp.h").read_text()
    (src / "fast_exp.h").write_text(header + "// edited\n")
    assert kbuild.cache_key(src / "swiglu.cc", cxx) != key, "an edited header changes the key"
    (src / "fast_exp.h").write_text(header)
    assert kbuild.cache_key(src / "swiglu.cc", cxx) == key
    # the build really compiles against the edited header: a broken one fails instead of reusing `lib`
    (src / "fast_exp.h").write_text(header.replace("inline float exp_nonpositive", "#error edited header\ninline float exp_nonpositive"))
    with pytest.raises(LabkitFailure, match="edited header"):
        kbuild.build("swiglu", cache=tmp_path / "cache")


def feed_forward():
    import mindspore as ms

    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    from mindformers.models.llama.llama_layer import LlamaFeedForward

    return LlamaFeedForward(128, intermediate_size=352, compute_dtype=ms.float32)


def tiny_llama():
    from labkit.config import load_run_config
    from labkit.model.llama import build_model

    return build_model(load_run_config("configs/tiny_cpu.yaml", []).model_config(), seq_length=64, batch_size=2)


@pytest.mark.parametrize("kernel, op, switch, model", [
    ("rmsnorm", "rms_norm_op", "use_custom_rms_norm", lambda: pair(layers=2)[0]),
    ("swiglu", "swiglu_op", "use_custom_swiglu", feed_forward),
    ("rope", "rope_op", "use_custom_rope", lambda: rope_pair()[0]),
    ("attn_softmax", "attn_softmax_op", "use_custom_attn_softmax", tiny_llama),
    ("xent", "xent_op", "use_custom_cross_entropy", lambda: loss_pair()[0]),
])
def test_no_compiler_keeps_native_cells_with_one_notice(monkeypatch, kernel, op, switch, model):
    import importlib

    module = importlib.import_module(f"labkit.model.kernels.{kernel}")
    monkeypatch.setattr(module, "build", lambda name: None)
    getattr(module, op).cache_clear()
    try:
        net = model()
        before = [type(c).__name__ for _, c in net.cells_and_names()]
        notices = []
        assert getattr(module, switch)(net, log=notices.append) == 0
        assert len(notices) == 1 and "no C++ compiler" in notices[0]
        assert [type(c).__name__ for _, c in net.cells_and_names()] == before
    finally:
        getattr(module, op).cache_clear()


def test_custom_swiglu_equals_native_values_and_gradients():
    import mindspore as ms

    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    from mindformers.models.llama.llama_layer import LlamaFeedForward

    from labkit.model.kernels.swiglu import use_custom_swiglu

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(2)
    native, custom = (LlamaFeedForward(128, intermediate_size=352, compute_dtype=ms.float32) for _ in range(2))
    for p, q in zip(native.trainable_params(), custom.trainable_params()):
        w = rng.normal(0, 0.1, p.shape).astype(np.float32)
        p.set_data(ms.Tensor(w))
        q.set_data(ms.Tensor(w.copy()))
    assert use_custom_swiglu(custom) == 1
    x = ms.Tensor(rng.normal(0, 2, (4, 64, 128)).astype(np.float32))
    dy = ms.Tensor(rng.normal(0, 1, (4, 64, 128)).astype(np.float32))
    yn, ln, dxn, dwn = value_and_grads(native, x, dy)
    yc, lc, dxc, dwc = value_and_grads(custom, x, dy)
    assert close(yn, yc) and lc == pytest.approx(ln, rel=RTOL) and close(dxn, dxc)
    assert all(close(a, b) for a, b in zip(dwn, dwc))
    # the operator alone against the formula, in float64: silu(g) * u, not g * u (a missing activation fails)
    from labkit.model.kernels.swiglu import swiglu_op

    g, u = (rng.normal(0, 3, (64, 352)).astype(np.float32) for _ in range(2))
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    got = swiglu_op()(ms.Tensor(g), ms.Tensor(u)).asnumpy()
    assert close(want, got) and not close(g * u, got)


def silu_tolerances(g, u, d, s):
    """Element-wise bounds on |float32 result - float64 result| for silu(g) * u and its gradients, from float32
    rounding: unit roundoff r = 2^-24; exp_nonpositive is within 1.4 r, and each of out, du, dg takes at most ~6
    more roundings, so 8 r of the magnitude of the terms. dg = d u s (1 + g (1 - s)): its terms are 1 and
    |g (1 - s)|, and 1 - s cancels for g > 0 (absolute error ~r while e^-g > r, i.e. g < ln 2^24 ~ 17; past that s
    rounds to 1 and the dropped g e^-g is below r): hence min(|g|, 17). The sigmoid of g < -87.3 is 0 (the
    exponential is clamped there) instead of a value below 1.2e-38 < 2^-125: an absolute term 2^-125 times the
    other factors. MindSpore's CPU threads run with flush-to-zero (a result below the smallest normal float
    2^-126 comes back as 0, as measured): an absolute 2^-126 on every result."""
    r, tiny = 2.0**-24, 2.0**-125
    silu = g * s
    out = 8 * r * np.abs(silu * u) + tiny * np.abs(g * u) + 2.0**-126
    du = 8 * r * np.abs(silu * d) + tiny * np.abs(g * d) + 2.0**-126
    dg = (8 * r * np.abs(d * u * s) * (1 + np.abs(g * (1 - s)) + np.minimum(np.abs(g), 17))
          + tiny * np.abs(d * u) * (1 + np.abs(g)) + 2.0**-126)
    return out, du, dg


def test_custom_swiglu_is_stable_for_huge_gates():
    """Gates of +-100 and +-1e4 (exp(1e4) overflows float32) and the exponential's clamp at -87.3: the operator and
    its gradient against the float64 formula, element by element, within silu_tolerances; no NaN or Inf. The
    plain float32 formula 1 / (1 + exp(-g)) (the native cells') meets the same bounds, and a sigmoid with the
    g < 0 branch dropped (1 / (1 + exp(-|g|)) everywhere) is far outside them."""
    import mindspore as ms

    from labkit.model.kernels.swiglu import swiglu_op

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(5)
    special = [0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, -1.28, 16.0, 17.0, 20.0, -20.0, 87.0, -87.0, 87.3, -87.3,
               88.0, -88.0, 90.0, -90.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38]
    g = np.concatenate([special, rng.normal(0, 3, 512 - 2 * len(special)), rng.normal(0, 40, len(special))])
    g = g.astype(np.float32).reshape(8, 64)
    u, d = (rng.normal(0, 1, g.shape).astype(np.float32) for _ in range(2))
    op, dout = swiglu_op(), ms.Tensor(d)

    def weighted(a, b):
        return (op(a, b) * dout).sum()

    out = op(ms.Tensor(g), ms.Tensor(u)).asnumpy()
    dg, du = ms.jit(ms.grad(weighted, (0, 1)))(ms.Tensor(g), ms.Tensor(u))
    dg, du = dg.asnumpy(), du.asnumpy()
    g64, u64, d64 = (x.astype(np.float64) for x in (g, u, d))
    s64 = np.exp(-np.logaddexp(0, -g64))  # sigmoid without overflow
    want = (g64 * s64 * u64, d64 * g64 * s64, d64 * u64 * s64 * (1 + g64 * (1 - s64)))
    tol = silu_tolerances(g64, u64, d64, s64)
    for got in (out, du, dg):
        assert np.all(np.isfinite(got[np.abs(g) < 1e38])), "finite for every gate short of float32's edge"
    for name, got, w, t in zip(("out", "du", "dg"), (out, du, dg), want, tol):
        bad = np.abs(got - w) > t
        assert not bad.any(), f"{name}: g={g[bad][:5]} got={got[bad][:5]} want={w[bad][:5]}"
    for gate in (-100.0, -1e4, -3e38):  # silu(g) u ~ -0, as the native cells give
        assert abs(out[0, special.index(gate)]) <= 1e-35 and abs(dg[0, special.index(gate)]) <= 1e-35
    # the bounds hold the native float32 formula too, and catch a sigmoid without its g < 0 branch
    with np.errstate(over="ignore"):
        s32 = np.float32(1) / (np.float32(1) + np.exp(-g))
    assert np.all(np.abs(g * s32 * u - want[0]) <= tol[0])
    s_wrong = 1 / (1 + np.exp(-np.abs(g64)))
    assert np.any(np.abs(g64 * s_wrong * u64 - want[0]) > tol[0])


def rope_pair(seq=64, head_dim=32):
    """Two cells that rotate query and key as mindformers' Llama attention does on CPU (`use_rope_slice=True`, the
    tables from its own `FreqsMgr`)."""
    import mindspore as ms
    from mindspore import nn

    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    from mindformers.modules.layers import FreqsMgr, RotaryEmbedding

    class Rotate(nn.Cell):
        def __init__(self):
            super().__init__()
            self.freqs = FreqsMgr(head_dim, seq_length=seq, max_position_embedding=seq, rotary_dtype=ms.float32)
            self.rope = RotaryEmbedding(head_dim, ms.float32, use_rope_slice=True)

        def construct(self, q, k):
            return self.rope(q, k, self.freqs(seq))

    return Rotate(), Rotate()


def test_custom_rope_equals_native_values_and_gradients():
    """Query [2, 4, 64, 32] and key [2, 2, 64, 32] (grouped KV heads): the rotated tensors and the gradients of a
    weighted sum with respect to both. Also the operator alone against the float64 formula, and its gradient
    against the transposed rotation; a backward that applied the forward rotation again would fail it."""
    import mindspore as ms

    from labkit.model.kernels.rope import rope_op, use_custom_rope

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    native, custom = rope_pair()
    assert use_custom_rope(custom) == 1
    rng = np.random.default_rng(4)
    q, k, dq, dk = (ms.Tensor(rng.normal(0, 1, shape).astype(np.float32))
                    for shape in ((2, 4, 64, 32), (2, 2, 64, 32)) * 2)

    def run(net):
        def weighted(a, b):
            qo, ko = net(a, b)
            return (qo * dq).sum() + (ko * dk).sum()

        gq, gk = ms.jit(ms.grad(weighted, (0, 1)))(q, k)
        return [t.asnumpy() for t in (*net(q, k), gq, gk)]

    for a, b in zip(run(native), run(custom)):
        assert close(a, b)
    # the operator alone, float64 reference: y = x cos + rot(x) sin, dx = dy cos + rot^T(dy sin)
    x, dy = rng.normal(0, 1, (3, 16, 32)), rng.normal(0, 1, (3, 16, 32))
    ang = rng.uniform(-np.pi, np.pi, (16, 32))
    cos, sin = np.cos(ang), np.sin(ang)

    def rot(v):
        return np.concatenate([-v[..., 16:], v[..., :16]], axis=-1)

    def rot_t(v):
        return np.concatenate([v[..., 16:], -v[..., :16]], axis=-1)

    f32 = [ms.Tensor(v.astype(np.float32)) for v in (x, cos, sin, dy)]
    op = rope_op()
    y = op(*f32[:3]).asnumpy()
    def weighted_op(a, c, s_):
        return (op(a, c, s_) * f32[3]).sum()

    dx = ms.jit(ms.grad(weighted_op, 0))(*f32[:3]).asnumpy()
    assert np.abs(y - (x * cos + rot(x) * sin)).max() <= 1e-6 * np.abs(x).max()
    assert np.abs(dx - (dy * cos + rot_t(dy * sin))).max() <= 1e-6 * np.abs(dy).max()
    assert np.abs(dx - (dy * cos + rot(dy * sin))).max() > 0.1  # the forward rotation is not its own transpose


def test_custom_rope_refuses_tables_of_another_shape():
    """Per-sample tables (a batch axis: B x S x D values) are not the kernel's [S, D]: MindSpore raises instead of
    the kernel reading past the table."""
    import mindspore as ms

    from labkit.model.kernels.rope import rope_op

    x = ms.Tensor(np.ones((2, 2, 8, 16), np.float32))
    table = ms.Tensor(np.ones((2, 1, 8, 16), np.float32))
    with pytest.raises(Exception):
        rope_op()(x, table, table).asnumpy()


@pytest.mark.slow
def test_custom_attention_softmax_equals_native_loss_and_gradients():
    """The tiny Llama (4 layers, seq 64) with its attention softmax switched: the same loss and every parameter's
    gradient within 1e-5 of the native model's; then the operator alone against float64 with a mask broadcast over
    heads, forward and backward (a backward without the row's dot product fails it)."""
    import mindspore as ms

    from labkit.config import load_run_config
    from labkit.model.kernels.attn_softmax import attn_softmax_op, use_custom_attn_softmax
    from labkit.model.llama import build_model

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    mc = load_run_config("configs/tiny_cpu.yaml", ["model.num_layers=2"]).model_config()  # a layer feeds a layer
    native, custom = (build_model(mc, seq_length=64, batch_size=2, seed=0) for _ in range(2))
    assert use_custom_attn_softmax(custom) == mc.num_layers
    tokens = ms.Tensor(np.random.default_rng(6).integers(0, mc.vocab_size, (2, 65)).astype(np.int32))

    def loss_and_grads(model):
        model.set_train(True)

        def forward(t):
            return model(t)

        value, grads = ms.jit(ms.value_and_grad(forward, None, model.trainable_params()))(tokens)
        return float(value.asnumpy()), [g.asnumpy() for g in grads]

    (ln, gn), (lc, gc) = loss_and_grads(native), loss_and_grads(custom)
    assert lc == pytest.approx(ln, rel=RTOL) and all(close(a, b) for a, b in zip(gn, gc))

    rng = np.random.default_rng(7)
    score, dp = rng.normal(0, 3, (2, 3, 16, 16)), rng.normal(0, 1, (2, 3, 16, 16))
    mask = np.where(np.tril(np.ones((16, 16))) > 0, 0.0, -10000.0)[None, None].repeat(2, axis=0)  # [2, 1, S, S]
    scale = 0.25
    z = score * scale + mask
    p64 = np.exp(z - z.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    ds64 = scale * p64 * (dp - (dp * p64).sum(-1, keepdims=True))
    args = [ms.Tensor(v.astype(np.float32)) for v in (score, mask, np.array([scale]))]
    op, dout = attn_softmax_op(), ms.Tensor(dp.astype(np.float32))

    def weighted(s_, m, c):
        return (op(s_, m, c) * dout).sum()

    p32 = op(*args).asnumpy()
    ds32 = ms.jit(ms.grad(weighted, 0))(*args).asnumpy()
    assert np.abs(p32 - p64).max() <= 1e-6 and np.abs(ds32 - ds64).max() <= 1e-5 * np.abs(ds64).max()
    assert np.abs(ds32 - scale * p64 * dp).max() > 1e-2  # the dot-product term matters


def loss_pair():
    """Two mindformers `CrossEntropyLoss` cells, each the `loss` attribute of a cell as in `LlamaForCausalLM`."""
    from mindspore import nn

    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    from mindformers.core.loss.loss import CrossEntropyLoss

    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.loss = CrossEntropyLoss()

        def construct(self, logits, labels, mask):
            return self.loss(logits, labels, mask)

    return Head(), Head()


def xent_value_and_grad(net, logits, labels, mask):
    import mindspore as ms

    value, dlogits = ms.jit(ms.value_and_grad(net, 0))(logits, labels, mask)
    return value.asnumpy(), dlogits.asnumpy()


def test_custom_cross_entropy_equals_native_loss_and_logit_gradient():
    """[64, 4096] logits, a quarter of the rows masked; among the labels an ignore index (-100) and V (one past
    the vocabulary), masked and unmasked: mindformers' one-hot row of such a label is all zeros (loss 0, gradient
    softmax * dloss) and the custom operator does the same, so even the unmasked ones agree.
    Tolerance: every row sums V = 4096 exponentials in another order (vectorised partial sums) with a polynomial exp
    of < 1e-7 relative error; float32 rounding of a sum of n terms grows like sqrt(n) * 6e-8 (~4e-6 at n = 4096)
    relative on the sum, i.e. absolute on its log, and the loss is ~10. RTOL = 1e-5 of the largest value covers
    both, and a gradient without the one-hot term (a plausible kernel bug) is ~1/sum(mask) off at every label."""
    import mindspore as ms

    from labkit.model.kernels.xent import custom_cell_class, use_custom_cross_entropy, xent_op

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(3)
    n, v = 64, 4096
    x = rng.normal(0, 3, (n, v)).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int32)
    t[[0, 5]], t[[1, 6]] = -100, v  # rows 0, 1 masked below, rows 5, 6 not
    mask = (rng.random(n) > 0.25).astype(np.float32)
    mask[[0, 1]], mask[[5, 6]] = 0, 1
    native, custom = loss_pair()
    assert use_custom_cross_entropy(custom) == 1
    assert type(custom.loss) is custom_cell_class() and custom.loss.custom_xent is xent_op()
    args = (ms.Tensor(x), ms.Tensor(t), ms.Tensor(mask))
    ln, dn = xent_value_and_grad(native, *args)
    lc, dc = xent_value_and_grad(custom, *args)
    assert lc.shape == ln.shape and float(lc[0]) == pytest.approx(float(ln[0]), rel=RTOL)
    assert close(dn, dc)
    assert np.all(dc[mask == 0] == 0), "masked rows get no gradient"
    # the plausible bug the tolerance must catch: the gradient without the one-hot term
    rows = np.flatnonzero((mask == 1) & (t >= 0) & (t < v))
    no_onehot = dc.copy()
    no_onehot[rows, t[rows]] += 1 / mask.sum()
    assert not close(dn, no_onehot)
    # the operator alone against the float64 formula: logsumexp - x[label], 0 for a label outside [0, V); logits
    # also 10x wider, so that x - max spans the exponential's whole float32 range down to its clamp at -87.3
    for scale in (1, 10):
        x64 = x.astype(np.float64) * scale
        lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
        want = np.where((t >= 0) & (t < v), lse - x64[np.arange(n), np.clip(t, 0, v - 1)], 0)
        got = xent_op()(ms.Tensor(x * scale), ms.Tensor(t)).asnumpy()
        assert close(want, got)


def test_switched_loss_runs_the_custom_operator_and_keeps_parallel_cells_native():
    """A -inf logit (a vocabulary entry ruled out) makes mindformers' log-softmax -inf and its one-hot product
    0 * -inf = NaN; the custom kernel's exponential of -inf is ~1e-38 and the loss stays finite: the switched cell
    really calls the operator. A cell that returns numerator and denominator (per-token loss) is not switched."""
    import mindspore as ms

    from labkit.model.kernels.xent import use_custom_cross_entropy

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(4)
    x = rng.normal(0, 3, (8, 64)).astype(np.float32)
    x[2, 7] = -np.inf
    t, mask = rng.integers(8, 64, 8).astype(np.int32), np.ones(8, np.float32)
    native, custom = loss_pair()
    args = (ms.Tensor(x), ms.Tensor(t), ms.Tensor(mask))
    assert np.isnan(native(*args).asnumpy()).all()
    use_custom_cross_entropy(custom)
    x64 = np.where(np.isinf(x), -1e30, x).astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    assert float(custom(*args).asnumpy()[0]) == pytest.approx((lse - x64[np.arange(8), t]).mean(), rel=RTOL)
    per_token, _ = loss_pair()
    per_token.loss.calculate_per_token_loss = True
    assert use_custom_cross_entropy(per_token) == 0 and type(per_token.loss).__name__ == "CrossEntropyLoss"


def adamw_pair(seed=0):
    """Native nn.AdamWeightDecay and the fused one over the same four parameters (two decayed, two not)."""
    import mindspore as ms
    from mindspore import nn

    from labkit.model.kernels.adamw import optimizer_class

    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in ((300, 64), (64,), (1000, 33), (7,))]

    def make(cls):
        ps = [ms.Parameter(ms.Tensor(x.copy()), name=f"p{i}") for i, x in enumerate(init)]
        groups = [{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
                  {"params": [p for p in ps if p.ndim == 1], "weight_decay": 0.0}]
        return cls(groups, learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)

    return make(nn.AdamWeightDecay), make(optimizer_class()), rng


def test_fused_adamw_equals_mindspore_adamweightdecay_over_steps():
    """Five updates with a gradient scale: the fused optimizer (scale folded in) against MindSpore's optimizer fed
    the scaled gradients. Same formula and order, so moments agree to float32 rounding and weights to a few ulps
    (measured: moments identical, weights 2.4e-7 of 4.7); weights moved by ~0.05, far above the tolerance."""
    import mindspore as ms

    native, fused, rng = adamw_pair()
    scale = ms.Tensor(np.float32(0.37))

    @ms.jit
    def native_step(grads, s):
        return native(tuple(g * s for g in grads))

    @ms.jit
    def fused_step(grads, s):
        return fused(grads, s)

    before = [p.asnumpy().copy() for p in fused.parameters]
    for _ in range(5):
        grads = tuple(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)) for p in native.parameters)
        native_step(grads, scale)
        fused_step(grads, scale)
    pairs = zip([*native.parameters, *native.moments1, *native.moments2], [*fused.parameters, *fused.moments1,
                                                                          *fused.moments2])
    for a, b in pairs:
        assert a.name == b.name and close(a.asnumpy(), b.asnumpy()), a.name
    moved = max(float(np.abs(p.asnumpy() - b).max()) for p, b in zip(fused.parameters, before))
    assert moved > 1e-2
    assert int(fused.global_step.asnumpy()[0]) == int(native.global_step.asnumpy()[0]) == 5


def test_square_sum_matches_float64_and_the_update_refuses_mismatched_shapes():
    import mindspore as ms

    from labkit.model.kernels.adamw import adamw_ops

    update, square_sum = adamw_ops()
    g = np.random.default_rng(1).standard_normal((1000, 257)).astype(np.float32) * 3
    got = float(square_sum(ms.Tensor(np.float32(0.5)), ms.Tensor(g)).asnumpy())
    want = float(((0.5 * g.astype(np.float64)) ** 2).sum())
    assert abs(got - want) <= 1e-6 * want  # summed in double: only the final rounding to float32 (6e-8)
    p, m, v = (ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32)), name=n) for n in "pmv")
    one = ms.Tensor(np.float32(0.9))
    short = ms.Tensor(np.ones(8, np.float32))

    @ms.jit
    def step(grad):
        return update(p, m, v, one, one, one, one, one, grad, one)

    with pytest.raises(RuntimeError):  # a gradient of 8 values for a weight of 16: refused, never read past
        step(short)
    assert not np.any(p.asnumpy())


def test_no_compiler_keeps_mindspore_optimizer(monkeypatch):
    from types import SimpleNamespace

    import mindspore as ms

    from labkit.model.kernels import adamw
    from labkit.training.trainer import Trainer

    params = [ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="w")]
    me = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(kernels="custom"),
                                             parallel=SimpleNamespace(device_target="CPU")),
                         world=SimpleNamespace(mode="stand_alone"))
    assert Trainer._fused_optimizer(me, params) is adamw.optimizer_class()
    me.world.mode = "semi_auto_parallel"
    assert Trainer._fused_optimizer(me, params) is None
    me.world.mode = "stand_alone"
    monkeypatch.setattr(adamw, "build", lambda name: None)
    adamw.adamw_ops.cache_clear()
    try:
        assert Trainer._fused_optimizer(me, params) is None
    finally:
        adamw.adamw_ops.cache_clear()
