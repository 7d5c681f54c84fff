"""The collectives' names (labkit.byhand.comm.Op): each in exactly one dimension of `DIMENSIONS`, the
grouping the comparison with the textbook reads, and `Traffic` refuses any other name instead of counting a row
the comparison would drop."""
from __future__ import annotations

import pytest

from labkit.byhand.comm import DIMENSIONS, Op, Sent, Traffic
from labkit.course import parallel_lab
from labkit.errors import LabkitError


def test_every_name_is_in_exactly_one_dimension():
    where = {op: [d for d, dim in DIMENSIONS.items() if op in dim.textbook + dim.beside] for op in Op}
    assert all(len(dims) == 1 for dims in where.values()), {op: d for op, d in where.items() if len(d) != 1}
    assert parallel_lab.MAIN_OPS == {d: dim.textbook for d, dim in DIMENSIONS.items() if dim.textbook}


def test_traffic_counts_a_known_name_and_refuses_an_unknown_one():
    t = Traffic()
    t.add(Op.DP_ALL_REDUCE, 8.0)
    t.add("dp_all_reduce", 8.0, 4.0)  # the name as written in a result file is the same operation
    assert t.counts() == {Op.DP_ALL_REDUCE: Sent(2, 16.0, 12.0)}
    with pytest.raises(LabkitError, match="'dp_allreduce' is not a collective"):
        t.add("dp_allreduce", 8.0)
