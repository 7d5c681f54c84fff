"""Parity between an HF Llama (torch, float32) and its converted mindformers copy: passes when the conversion is
right, fails (exit 1) when a square matrix is transposed or rope_theta is wrong, both of which load fine."""
from __future__ import annotations

import json

import pytest

from labkit.weights import convert
from labkit.weights import hf_config
from labkit.weights import parity
from labkit.model.shapes import num_params
from labkit.errors import LabkitError, LabkitFailure


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    # MHA, untied head, odd vocab, rope_theta != 1e4, bf16 source (upcast to float32 on both sides)
    hf = parity.make_hf_llama(root / "hf", seed=3, dtype="bfloat16", vocab_size=1003, num_key_value_heads=4,
                              tie_word_embeddings=False, rope_theta=500000.0)
    convert.hf2ms(hf, root / "ms")
    return root, hf, root / "ms"


def test_fixed_tokens_are_deterministic():
    assert parity.fixed_tokens(1000, 16, seed=1) == parity.fixed_tokens(1000, 16, seed=1)
    assert parity.fixed_tokens(1000, 16, seed=1) != parity.fixed_tokens(1000, 16, seed=2)
    assert max(parity.fixed_tokens(5, 200)) == 4 and min(parity.fixed_tokens(5, 200)) == 0


@pytest.mark.slow
def test_parity_passes(pair):
    _, hf, ms = pair
    r = parity.run_parity(hf, ms, seq_len=24, gen_tokens=6)
    assert r["passed"], r
    assert r["max_abs_diff"] <= 1e-3 and r["argmax_agreement"] == 1.0 and r["generation_match"]
    assert len(r["hf_generated"]) == 6 and r["config_diff"] == {}
    assert r["params"] == num_params(hf_config.read_model_config(ms))


@pytest.mark.slow
def test_transposed_square_matrix_loads_but_fails_parity(pair, monkeypatch, capfd):
    root, hf, _ = pair
    bad = parity.make_variant(parity.make_hf_llama(root / "f32", seed=3), root / "t",
                              transpose=["model.layers.0.self_attn.q_proj.weight"])
    convert.hf2ms(bad, root / "t_ms")  # shapes are all right: conversion cannot see it
    from labkit import cli

    monkeypatch.setattr(cli, "COMMANDS", {k: cli.COMMANDS[k] for k in ("convert", "parity")})
    code = cli.main(["parity", "--hf", str(root / "f32"), "--ms", str(root / "t_ms"), "--seq-len", "16",
                     "--gen-tokens", "4", "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 1 and r["passed"] is False and r["ok"] is False
    assert r["max_abs_diff"] > 0.1 and r["argmax_agreement"] < 1.0


@pytest.mark.slow
def test_wrong_rope_theta_is_caught_and_named(pair):
    root, hf, _ = pair
    wrong = parity.make_variant(parity.make_hf_llama(root / "f32b", seed=3), root / "th", config={"rope_theta": 1e4 * 3})
    convert.hf2ms(wrong, root / "th_ms")
    r = parity.run_parity(root / "f32b", root / "th_ms", seq_len=16, gen_tokens=2)
    assert not r["passed"] and r["max_abs_diff"] > 1e-2
    assert r["config_diff"] == {"rope_theta": [10000.0, 30000.0]}


def test_vocab_mismatch_and_bad_windows(pair, tmp_path):
    root, hf, ms = pair
    other = parity.make_hf_llama(tmp_path / "other", vocab_size=1000)
    with pytest.raises(LabkitFailure, match="vocab sizes differ: HF 1000, MindSpore 1003"):
        parity.run_parity(other, ms)
    with pytest.raises(LabkitError, match="max_position_embeddings"):
        parity.run_parity(hf, ms, seq_len=250, gen_tokens=10)


def test_config_diff_says_when_it_could_not_compare(tmp_path):
    """An unreadable config.json is not "the configs agree" (that is {})."""
    missing = parity.config_diff(tmp_path / "nowhere", tmp_path / "ms")
    assert list(missing) == ["not_compared"] and "config.json" in missing["not_compared"]
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    broken = parity.config_diff(tmp_path, tmp_path / "ms")
    assert broken != {} and "JSONDecodeError" in broken["not_compared"]


def test_size_limit_statement():
    s = parity.size_limit(24 * 2**30)
    assert 3e9 < s["max_params"] < 5e9 and "GiB" in s["text"]
