"""labkit.model.shapes is the one source of parameter shapes and counts: checked against the model mindformers
really builds (no_init: exact shapes, no weights) and against the published Llama-2-7B count."""
import math

import pytest

from labkit.config import model_preset
from labkit.model import shapes
from labkit.model.llama import build_model
from labkit.weights.name_map import hf_to_ms

LLAMA2_7B_PUBLISHED = 6_738_415_616  # Touvron et al. 2023 / the HF checkpoint's safetensors index


@pytest.mark.parametrize("name, overrides", [("tiny", {}), ("tiny", {"tie_word_embeddings": True}),
                                             ("llama_100m", {"num_layers": 2})])
def test_shapes_are_what_mindformers_builds(name, overrides):
    cfg = model_preset(name, **overrides)
    model = build_model(cfg, seq_length=16, no_init=True)
    built = {p.name: tuple(p.shape) for p in model.trainable_params()}
    expected = {hf_to_ms(k): v for k, v in shapes.expected_hf_shapes(cfg).items()}
    assert built == expected
    assert sorted(shapes.grad_shapes(cfg)) == sorted(built.values())
    assert shapes.num_params(cfg) == sum(math.prod(s) for s in built.values())


def test_llama2_7b_count_is_the_published_one():
    counts = shapes.param_counts(model_preset("llama2_7b"))
    assert counts["total"] == LLAMA2_7B_PUBLISHED
    parts = counts["embedding"] + counts["layers"] + counts["final_norm"] + counts["lm_head"]
    assert parts == counts["total"] and counts["per_layer"] * 32 == counts["layers"]
