"""The hand-written pipeline's programs (labkit.byhand.pipeline_parallel): both stages take part in the transfers in
the same order, each micro-batch runs forward then backward once per stage. The programs run between processes in
the msrun runs (tests/test_layouts.py); the simulator draws the same order (tests/test_pipeline_sim.py)."""
from __future__ import annotations

import pytest

from labkit.byhand.pipeline_parallel import programs, transfers


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_pipeline_programs_pair_their_transfers(schedule, m):
    """Broadcasts pair up only if both stages take part in them in the same order; every micro-batch is computed
    forward then backward once on each stage; the stashed micro-batches peak at m (GPipe) or p - stage (1F1B)."""
    prog = programs(schedule, m)
    assert transfers(prog[0]) == transfers(prog[1])
    for stage in (0, 1):
        computed = [(a, j) for a, j in prog[stage] if a in ("F", "B")]
        assert sorted(computed) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        assert all(computed.index(("F", j)) < computed.index(("B", j)) for j in range(m))
        live = peak = 0
        for a, _ in computed:
            live += 1 if a == "F" else -1
            peak = max(peak, live)
        assert peak == (m if schedule == "gpipe" else min(m, 2 - stage))
