"""t workers of one process as a group for the one-process tests of hand-written parallel code: each worker is a
thread, and a collective hands every member's tensor to all at a barrier. One thread computes at a time (MindSpore's
eager executor is not safe for concurrent callers): a member computes only while it holds `turn`, which it gives up
while it waits at a collective. A `Member` answers the calls labkit.byhand.comm.Group answers (size, index,
all_reduce, all_gather, reduce_scatter, stack_by_sum, transfer, shift, all_to_all), without counting traffic. A `World` of n threads
has any number of such groups, all under one `turn`: the grid of a layout with several dimensions."""
from __future__ import annotations

import threading

import numpy as np


class Threads:
    """`size` threads of this process as one group: each collective hands every member's tensor to all. A member
    computes only while it holds `turn`, which it gives up while it waits at a collective."""

    def __init__(self, size: int, turn: threading.Lock | None = None):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=60), [None] * size
        self.turn = turn or threading.Lock()

    def run(self, fn) -> list:
        """fn(member) on every member at once; the results in member order."""
        return _run(self.size, self.turn, lambda i: fn(Member(self, i)), [self])


class World:
    """n threads of this process; `group(ranks, rank)` is rank's Member of the group of `ranks` (made on first
    use, shared by its members), every group under the world's one `turn`."""

    def __init__(self, n: int):
        self.n, self.turn, self.groups = n, threading.Lock(), {}

    def group(self, ranks, rank: int) -> Member:
        ranks = tuple(sorted(ranks))
        if ranks not in self.groups:  # called while holding the turn: one thread at a time
            self.groups[ranks] = Threads(len(ranks), self.turn)
        return Member(self.groups[ranks], ranks.index(rank))

    def run(self, fn) -> list:
        """fn(rank) on every rank at once; the results in rank order."""
        return _run(self.n, self.turn, fn, lambda: self.groups.values())


def _run(n: int, turn: threading.Lock, fn, groups) -> list:
    """fn(i) for i < n, each in its own thread taking turns; a failure aborts every group's barrier (so that no
    member waits for it) and is raised here. MindSpore's switch for autodiff is one per process: `_Function.apply`
    (labkit.byhand.mappings.differentiable) turns it off for its forward and restores what it found, so members
    whose forwards interleave at a collective can leave it off; it is put back as it was when all are done."""
    from mindspore.graph.api import _pynative_executor

    grad = _pynative_executor.enable_grad()
    out, errors = [None] * n, []

    def body(i):
        turn.acquire()
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            for g in (groups() if callable(groups) else groups):
                g.barrier.abort()
        finally:
            turn.release()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _pynative_executor.set_enable_grad(grad)
    if errors:
        raise errors[0]
    return out


class Member:
    def __init__(self, threads: Threads, index: int):
        self.threads, self.size, self.index = threads, threads.size, index

    def _exchange(self, x) -> list:
        self.threads.slots[self.index] = x.asnumpy()
        self.threads.turn.release()
        try:
            self.threads.barrier.wait()
            every = list(self.threads.slots)  # every member copies before any writes its next tensor
            self.threads.barrier.wait()
        finally:
            self.threads.turn.acquire()
        return every

    def all_reduce(self, x, name: str = ""):
        import mindspore

        return x if self.size == 1 else mindspore.Tensor(np.sum(self._exchange(x), axis=0))

    def transfer(self, x, src: int, name: str = ""):
        import mindspore

        return mindspore.Tensor(self._exchange(x)[src])

    def stack_by_sum(self, x, name: str = ""):
        import mindspore

        return mindspore.Tensor(np.stack(self._exchange(x)))

    def all_gather(self, x, axis: int = 0, name: str = ""):
        import mindspore

        return mindspore.Tensor(np.concatenate(self._exchange(x), axis=axis))

    def reduce_scatter(self, x, axis: int = 0, name: str = ""):
        import mindspore

        total = np.sum(self._exchange(x), axis=0)
        return mindspore.Tensor(np.array_split(total, self.size, axis=axis)[self.index])

    def shift(self, x, by: int, name: str = ""):
        import mindspore

        return mindspore.Tensor(self._exchange(x)[(self.index - by) % self.size])

    def all_to_all(self, x, split_axis: int, concat_axis: int, name: str = ""):
        import mindspore

        every = [np.array_split(t, self.size, axis=split_axis)[self.index] for t in self._exchange(x)]
        return mindspore.Tensor(np.concatenate(every, axis=concat_axis))
