"""mappings.differentiable (labkit.byhand.mappings), the one adapter to MindSpore's private `_Function`: its forward
is the given forward, its gradient the given backward (not autodiff's), in PyNative mode, in one process; and a
MindSpore whose `_Function` is gone or has another protocol is a LabkitError naming the version and what changed."""
import numpy as np
import pytest

from labkit.byhand import comm, mappings, tensor_parallel
from labkit.errors import LabkitError


@pytest.fixture
def fresh_check():
    """The protocol check run again for this test, and again after it (the real `_Function` for the others)."""
    mappings.function_base.cache_clear()
    yield
    mappings.function_base.cache_clear()


def test_forward_is_the_forward_and_the_gradient_is_the_hand_written_backward(ms):
    # backward 10·dy, where autodiff of 3x would give 3·dy: the gradient can only come from the given backward
    f = mappings.differentiable(lambda x: x * 3.0, lambda d: d * 10.0)
    x, w = ms.Tensor(np.array([1.0, -2.0, 0.5], np.float32)), ms.Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    np.testing.assert_array_equal(f(x).asnumpy(), [3.0, -6.0, 1.5])
    np.testing.assert_array_equal(ms.grad(lambda v: (f(v) * w).sum())(x).asnumpy(), [10.0, 20.0, 30.0])


def test_with_saves_the_backward_gets_what_the_forward_kept_and_more_inputs_no_gradient(ms):
    f = mappings.differentiable(lambda x, k: (x * k, (k,)), lambda kept, d: d * kept[0] * 2.0, saves=True)
    x, k = ms.Tensor(np.array([1.0, 2.0], np.float32)), ms.Tensor(np.array([5.0, 7.0], np.float32))
    np.testing.assert_array_equal(f(x, k).asnumpy(), [5.0, 14.0])
    np.testing.assert_array_equal(ms.grad(lambda v: f(v, k).sum())(x).asnumpy(), [10.0, 14.0])


def test_one_subclass_per_pair_whatever_the_calls(ms):
    f = tensor_parallel.vocab_parallel_cross_entropy(comm.Group("none", 1, 0))
    logits, labels = ms.Tensor(np.zeros((2, 4), np.float32)), ms.Tensor(np.array([1, 3], np.int32))
    f(logits, labels), f(logits, labels)
    assert issubclass(f.__self__, mappings.function_base())  # the bound `apply` of the pair's one class
    assert tensor_parallel.vocab_parallel_cross_entropy(comm.Group("none", 1, 0)).__self__ is not f.__self__


def test_a_missing_function_class_is_named_with_the_version(ms, monkeypatch, fresh_check):
    import mindspore.common

    monkeypatch.delattr(mindspore.common, "_Function")
    with pytest.raises(LabkitError, match=rf"MindSpore {ms.__version__} has no class mindspore.common._Function"):
        mappings.differentiable(lambda x: x, lambda d: d)


def test_a_changed_protocol_names_what_is_missing(ms, monkeypatch, fresh_check):
    import mindspore.common

    class Renamed:  # a later MindSpore's shape, say: forward and backward kept, `apply` renamed to `call`
        forward = backward = save_for_backward = call = staticmethod(lambda *a: None)

    monkeypatch.setattr(mindspore.common, "_Function", Renamed)
    with pytest.raises(LabkitError, match=rf"MindSpore {ms.__version__}'s mindspore.common._Function lacks apply "):
        mappings.differentiable(lambda x: x, lambda d: d)
