"""t workers of one process as a group for the one-process tests of hand-written parallel code: each worker is a
thread, and a collective hands every member's tensor to all at a barrier. One thread computes at a time (MindSpore's
eager executor is not safe for concurrent callers): a member computes only while it holds `turn`, which it gives up
while it waits at a collective. A `Member` answers the calls labkit.byhand.comm.Group answers (size, index,
all_reduce, all_gather, reduce_scatter, stack_by_sum), without counting traffic."""
from __future__ import annotations

import threading

import numpy as np


class Threads:
    """`size` threads of this process as one group: each collective hands every member's tensor to all. A member
    computes only while it holds `turn`, which it gives up while it waits at a collective."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=60), [None] * size
        self.turn = threading.Lock()

    def run(self, fn) -> list:
        """fn(member) on every member at once; the results in member order."""
        out, errors = [None] * self.size, []

        def body(i):
            self.turn.acquire()
            try:
                out[i] = fn(Member(self, i))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                self.barrier.abort()
            finally:
                self.turn.release()

        threads = [threading.Thread(target=body, args=(i,)) for i in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
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

        return mindspore.Tensor(np.sum(self._exchange(x), axis=0))

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
