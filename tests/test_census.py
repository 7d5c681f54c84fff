"""The state census: mindformers' own training cell, built under msrun for the YAML of each amp level, holds what
labkit/parallel/state_census.json (the planner's source) says, and the planner's element counts per kind are the
framework's."""
from __future__ import annotations

import pytest

from labkit.config import AMP_LEVELS
from labkit.launch import census as take
from labkit.layout import Layout
from labkit.parallel import census, memory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    return take.take(tmp_path_factory.mktemp("census"))


def test_the_census_is_the_file_the_planner_reads(found):
    states = census.load_states()
    assert states["versions"] == census.versions()
    assert found == states["cases"], "mindformers allocates otherwise now: python -m labkit.launch.census --write"
    assert {c["amp_level"] for c in found.values()} == set(AMP_LEVELS)


def test_the_planner_counts_the_censused_model_as_mindformers_built_it(found):
    """Per weight kind, the elements the planner counts from labkit's shapes (stage_weights) are the ones mindformers
    created; the planner's unsharded state bytes are then the census's bytes, role by role."""
    cfg = census.census_model()
    st = memory.stage_weights(cfg)["only"]
    counted = {k: sum(w.count * w.elements(1) for w in st["weights"] if w.kind == k) for k in census.KINDS}
    for name, case in found.items():
        assert counted == {k: case["weight_elements"][k] for k in census.KINDS}, name
        accum = 2 if case["wrapper"] == memory.PIPELINE else 1
        states = memory.model_states(cfg, Layout(dp=2, accum=accum), memory.Numerics(case["amp_level"]), st)
        roles = case["roles"]
        byte = lambda role: sum(roles[role][k]["bytes_per_element"] * counted[k] for k in roles[role])  # noqa: E731
        assert states["weights"] == pytest.approx(byte("weights"))
        assert states["optimizer"] == pytest.approx(byte("moments"))
        if "accu_grads" in roles:
            assert states["gradients"] == pytest.approx(byte("accu_grads"))
