"""The lab's C++ RMSNorm, SwiGLU and cross-entropy operators equal mindformers' native cells (values and
gradients), their build cache is keyed by the CPU, and a machine without a compiler falls back to the native cells
with one notice."""
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


def test_no_compiler_keeps_native_cells_with_one_notice(monkeypatch):
    from labkit.model.kernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "build", lambda name: None)
    rmsnorm.rms_norm_op.cache_clear()
    try:
        native, _ = pair(layers=2)
        notices = []
        assert rmsnorm.use_custom_rms_norm(native, log=notices.append) == 0
        assert len(notices) == 1 and "no C++ compiler" in notices[0]
        assert all(type(c).__name__ == "LlamaRMSNorm" for c in native.norms)
    finally:
        rmsnorm.rms_norm_op.cache_clear()


def test_no_compiler_keeps_the_native_cross_entropy_with_one_notice(monkeypatch):
    from labkit.model.kernels import xent

    monkeypatch.setattr(xent, "build", lambda name: None)
    xent.xent_op.cache_clear()
    try:
        head, _ = loss_pair()
        notices = []
        assert xent.use_custom_cross_entropy(head, log=notices.append) == 0
        assert len(notices) == 1 and "no C++ compiler" in notices[0]
        assert type(head.loss).__name__ == "CrossEntropyLoss"
    finally:
        xent.xent_op.cache_clear()


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


@pytest.mark.slow
def test_custom_kernels_train_to_the_golden_losses_and_an_impossible_mfu_is_warned(tmp_path):
    """The tiny run with train.kernels=custom reproduces the committed native losses (the golden test's 2e-4);
    a peak set far too low gives an MFU above 1, which `labkit train` reports and does not stop on."""
    import json
    from pathlib import Path

    from labkit.config import load_run_config
    from labkit.training.trainer import train

    golden = json.loads((Path(__file__).parent / "golden" / "tiny_cpu_losses.json").read_text())["losses"]
    cfg = load_run_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=4", "train.micro_batch=8",
                                                    "train.accum=1", "train.save_every=0", "train.kernels=custom",
                                                    "train.peak_tflops=0.000001"])
    said = []
    summary = train(cfg, log=said.append)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(golden[:4], abs=2e-4)
    assert summary["mfu"] > 1 and any("MFU" in m and "impossible" in m for m in said)
