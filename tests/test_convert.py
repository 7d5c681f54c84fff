"""HF <-> MindSpore conversion: config rules, mapping, bit-exact round trips, clear failures, atomic output.

No real Llama checkpoint is on disk and none may be downloaded: the checkpoints here are small random Llamas
created with transformers in several configurations (GQA/MHA, tied/untied, odd vocab, rope_theta != 1e4,
fp16/bf16 sources, sharded safetensors, pytorch_model.bin)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from labkit.weights import formats as ckpt_io
from labkit.weights import convert
from labkit import logs
from labkit.model import shapes
from labkit.model.shapes import num_params
from labkit.weights import hf_config
from labkit.weights import name_map as mapping
from labkit.weights import parity
from labkit.errors import LabkitError

VARIANTS = {
    "gqa_tied_f32": dict(),
    "mha_untied_oddvocab_bf16": dict(dtype="bfloat16", vocab_size=1003, num_key_value_heads=4,
                                     tie_word_embeddings=False),
    "theta_fp16_sharded": dict(dtype="float16", rope_theta=500000.0, max_shard_size="60KB"),
    "bin_tied": dict(safe_serialization=False),
    "bin_sharded_untied": dict(safe_serialization=False, max_shard_size="60KB", tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: parity.make_hf_llama(root / name, seed=i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("ms")
    return {name: (convert.hf2ms(src, root / name), root / name) for name, src in hf_dirs.items()}


def _raw_tensors(d: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, raw bytes), from safetensors or pytorch_model.bin, without any float conversion."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out[k] = (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes())
    for f in sorted(d.glob("pytorch_model*.bin")):
        for k, t in torch.load(f, weights_only=True).items():
            out[k] = (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def _no_leftovers(dst: Path) -> bool:
    return not dst.exists() and not list(dst.parent.glob(f".tmp-{dst.name}-*"))


# ----------------------------------------------------------------------------------------- config rules

BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64,
            intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=[2, 7], initializer_range=0.03)


def test_config_fields_map():
    cfg = hf_config.model_config_from_hf(BASE, name="x")
    assert (cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (2, 5e5, 1e-5, True)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.init_std) == (176, 256, 0.03)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)  # first eos; no pad -> 0
    assert num_params(cfg) == 1000 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64) + 64
    # HF's own defaults apply to absent keys (not labkit's)
    bare = {k: v for k, v in BASE.items() if k not in ("rms_norm_eps", "rope_theta", "num_key_value_heads")}
    d = hf_config.model_config_from_hf(bare)
    assert (d.rms_norm_eps, d.rope_theta, d.kv_heads) == (1e-6, 1e4, 4)


@pytest.mark.parametrize("change, key", [
    (dict(head_dim=32), "head_dim"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "model_type"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096), "sliding_window"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(quantization_config={"bits": 4}), "quantization_config"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_config_refusals_name_the_key(change, key):
    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(LabkitError, match=key):
        hf_config.model_config_from_hf(cfg)


def test_plain_rope_scaling_and_mistral_without_window_are_accepted():
    hf_config.model_config_from_hf({**BASE, "rope_scaling": {"rope_type": "default"}})
    hf_config.model_config_from_hf({**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                  "sliding_window": None})


def test_unsupported_config_writes_nothing(hf_dirs, tmp_path):
    src = parity.make_variant(hf_dirs["gqa_tied_f32"], tmp_path / "biased", config={"attention_bias": True})
    with pytest.raises(LabkitError, match="attention_bias"):
        convert.hf2ms(src, tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")


# --------------------------------------------------------------------------------------------- mapping


def test_mapping_is_a_bijection_and_agrees_with_mindformers():
    from labkit.config import model_preset

    logs.quiet_mindformers()
    from mindformers import LlamaForCausalLM

    for tied in (True, False):
        cfg = model_preset("tiny", tie_word_embeddings=tied)
        names = list(shapes.expected_hf_shapes(cfg))
        ms = [mapping.hf_to_ms(n) for n in names]
        assert len(set(ms)) == len(ms) and None not in ms
        assert [mapping.ms_to_hf(n) for n in ms] == names
        # mindformers' own HF name conversion (used by its safetensors loader) gives the same names
        assert ms == [LlamaForCausalLM.convert_name(n) for n in names]
        assert set(ms) == set(convert._target_shapes(cfg))
    assert all(r.layout == "same" for r in mapping.MAPPING)  # no transforms: parity tests prove it


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_is_bit_exact(name, hf_dirs, converted, tmp_path):
    report, ms_dir = converted[name]
    assert sorted(p.name for p in ms_dir.iterdir()) == sorted(
        ["model.ckpt", "model.yaml", "mindformers_model.yaml", "conversion.json", "generation_config.json"])
    back = tmp_path / "back"
    r = convert.ms2hf(ms_dir, back)
    assert r["bit_exact_to_source"] is True
    src, out = _raw_tensors(hf_dirs[name]), _raw_tensors(back)
    assert list(src) == list(out) or set(src) == set(out)
    for k in src:
        assert out[k] == src[k], k  # dtype and every byte
    orig = json.loads((hf_dirs[name] / "config.json").read_text())
    assert json.loads((back / "config.json").read_text()) == orig
    if VARIANTS[name].get("max_shard_size"):  # same shards; .bin shards come back as .safetensors
        idx = json.loads((back / "model.safetensors.index.json").read_text())
        src_index = next(hf_dirs[name].glob("*.index.json"))
        want = {k: v.replace("pytorch_model", "model").replace(".bin", ".safetensors")
                for k, v in json.loads(src_index.read_text())["weight_map"].items()}
        assert idx["weight_map"] == want and len(set(want.values())) > 1


def test_recorded_source_and_dtypes(converted):
    rep, d = converted["mha_untied_oddvocab_bf16"]
    rec = json.loads((d / "conversion.json").read_text())
    assert rep["dtype"] == rec["dtype"] == "bfloat16" and rep["source_dtypes"] == ["bfloat16"]
    assert {t["source_dtype"] for t in rec["tensors"]} == {"bfloat16"}
    assert len(rec["tensors"]) == 2 * 9 + 3 and rec["hf_config"]["vocab_size"] == 1003
    idx = ckpt_io.ckpt_index(d / "model.ckpt")
    assert {e.dtype for e in idx.values()} == {"bfloat16"}
    assert idx["model.tok_embeddings.embedding_weight"].shape == (1003, 64)
    rep, d = converted["bin_tied"]
    roles = [t["role"] for t in json.loads((d / "conversion.json").read_text())["tensors"]]
    assert roles.count("tied_copy") == 1  # pytorch_model.bin keeps lm_head.weight even when tied
    assert "lm_head.weight" not in ckpt_io.ckpt_index(d / "model.ckpt")


def test_transformers_loads_the_result_and_dtype_option(hf_dirs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    src = hf_dirs["mha_untied_oddvocab_bf16"]
    convert.hf2ms(src, tmp_path / "f32", dtype="float32")
    assert {e.dtype for e in ckpt_io.ckpt_index(tmp_path / "f32" / "model.ckpt").values()} == {"float32"}
    convert.ms2hf(tmp_path / "f32", tmp_path / "back")  # back in the recorded bf16, exactly
    assert _raw_tensors(tmp_path / "back") == _raw_tensors(src)
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype="auto")
    assert m.dtype == torch.bfloat16 and m.config.vocab_size == 1003


# ------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("kind, match", [
    ("missing", r"without a source: model\.layers\.1\.mlp\.up_proj\.weight"),
    ("transposed", r"gate_proj\.weight \[64, 176\].*looks transposed"),
    ("vocab", r"embed_tokens\.weight \[1000, 64\] but config\.json implies \[1024, 64\]"),
    ("unknown", r"without a target: model\.layers\.0\.self_attn\.q_proj\.bias"),
])
def test_broken_checkpoints_fail_clearly(kind, match, hf_dirs, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    base = hf_dirs["gqa_tied_f32"]
    if kind == "missing":
        src = parity.make_variant(base, tmp_path / "s", drop=["model.layers.1.mlp.up_proj.weight"])
    elif kind == "transposed":
        src = parity.make_variant(base, tmp_path / "s", transpose=["model.layers.0.mlp.gate_proj.weight"])
    elif kind == "vocab":
        src = parity.make_variant(base, tmp_path / "s", config={"vocab_size": 1024})
    else:
        src = parity.make_variant(base, tmp_path / "s")
        sd = load_file(src / "model.safetensors")
        sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LabkitError, match=match):
        convert.hf2ms(src, tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")


def test_tied_head_that_differs_is_refused(hf_dirs, tmp_path):
    import torch

    src = tmp_path / "x"
    src.mkdir()
    sd = torch.load(hf_dirs["bin_tied"] / "pytorch_model.bin", weights_only=True)
    sd["lm_head.weight"] = sd["lm_head.weight"].clone() + 1
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text((hf_dirs["bin_tied"] / "config.json").read_text())
    with pytest.raises(LabkitError, match="differs from model.embed_tokens.weight"):
        convert.hf2ms(src, tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_old_rotary_buffers_are_checked_and_kept(theta, hf_dirs, tmp_path):
    import torch

    src = tmp_path / "x"
    src.mkdir()
    sd = torch.load(hf_dirs["bin_tied"] / "pytorch_model.bin", weights_only=True)
    for i in range(2):  # what checkpoints saved before transformers 4.31 carry; computed with `theta`
        sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16)
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text((hf_dirs["bin_tied"] / "config.json").read_text())  # says rope_theta 1e4
    if theta != 10000.0:
        with pytest.raises(LabkitError, match="inv_freq does not match rope_theta=10000"):
            convert.hf2ms(src, tmp_path / "out")
        return
    convert.hf2ms(src, tmp_path / "out")
    convert.ms2hf(tmp_path / "out", tmp_path / "back")
    assert _raw_tensors(tmp_path / "back") == _raw_tensors(src)


def test_interrupted_conversion_leaves_nothing_complete(hf_dirs, tmp_path, monkeypatch):
    calls = []
    real = ckpt_io.CkptWriter.write

    def flaky(self, *a):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(ckpt_io.CkptWriter, "write", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert.hf2ms(hf_dirs["gqa_tied_f32"], tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")
    with pytest.raises(LabkitError, match="already exists"):
        (tmp_path / "taken").mkdir()
        convert.hf2ms(hf_dirs["gqa_tied_f32"], tmp_path / "taken")


def test_tokenizer_files_travel_both_ways(hf_dirs, tmp_path):
    src = parity.make_variant(hf_dirs["gqa_tied_f32"], tmp_path / "s")
    files = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}", "special_tokens_map.json": "{}"}
    for name, text in files.items():
        (src / name).write_text(text)
    assert set(files) <= set(convert.hf2ms(src, tmp_path / "ms")["copied_files"])
    convert.ms2hf(tmp_path / "ms", tmp_path / "back")
    assert all((tmp_path / "back" / n).read_text() == t for n, t in files.items())


def test_missing_and_incomplete_sources(tmp_path, hf_dirs):
    with pytest.raises(LabkitError, match="config.json not found"):
        convert.hf2ms(tmp_path, tmp_path / "out")
    src = tmp_path / "shards"
    src.mkdir()
    for f in hf_dirs["theta_fp16_sharded"].iterdir():
        if not f.name.startswith("model-00002"):
            (src / f.name).write_bytes(f.read_bytes())
    with pytest.raises(LabkitError, match="shards that are missing: model-00002"):
        convert.hf2ms(src, tmp_path / "out")


# --------------------------------------------------------------------------------- converted dir API


def test_load_and_write_converted(converted, tmp_path):
    _, d = converted["gqa_tied_f32"]
    cfg, tensors = convert.load_converted(d)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    emb = tensors["model.tok_embeddings.embedding_weight"]
    grown = dict(tensors, **{"model.tok_embeddings.embedding_weight": np.concatenate([emb, emb[:3]])})
    import dataclasses

    big = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 3)
    with pytest.raises(LabkitError, match="do not fit"):
        convert.write_converted(tmp_path / "bad", cfg, grown)
    convert.write_converted(tmp_path / "grown", big, grown, copy_from=d)
    r = convert.ms2hf(tmp_path / "grown", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 1003
    assert r["crc_matches_source"] == r["tensors"] - 1  # all but the grown embedding are untouched


def test_ms2hf_without_a_record_writes_a_loadable_hf_model(converted, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    _, d = converted["mha_untied_oddvocab_bf16"]
    cfg, tensors = convert.load_converted(d, bf16="bits")
    convert.write_converted(tmp_path / "plain", cfg, tensors, dtype="bfloat16")  # no conversion.json
    r = convert.ms2hf(tmp_path / "plain", tmp_path / "hf")
    assert r["bit_exact_to_source"] is None and r["files"] == ["model.safetensors"]
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert m.dtype == torch.bfloat16 and m.config.num_key_value_heads == 4 and not m.config.tie_word_embeddings
    assert torch.equal(m.lm_head.weight.view(torch.int16).flatten()[:50],
                       torch.from_numpy(tensors["lm_head.weight"].view(np.int16)).flatten()[:50])


def test_mindformers_yaml_builds_the_model(converted):
    import yaml

    _, d = converted["gqa_tied_f32"]
    block = yaml.safe_load((d / "mindformers_model.yaml").read_text())["model"]
    mc = block["model_config"]
    assert block["arch"]["type"] == "LlamaForCausalLM" and mc["type"] == "LlamaConfig"
    assert (mc["n_kv_heads"], mc["theta"], mc["tie_word_embeddings"]) == (2, 10000.0, True)


# ------------------------------------------------------------------------------------------------ CLI


def _cli(monkeypatch, capfd, *argv):
    from labkit import cli

    monkeypatch.setattr(cli, "COMMANDS", {k: cli.COMMANDS[k] for k in ("convert", "parity")})
    code = cli.main(list(argv))
    return code, capfd.readouterr()


def test_cli_json_success_and_failure(monkeypatch, capfd, hf_dirs, tmp_path):
    code, out = _cli(monkeypatch, capfd, "convert", "hf2ms", "--src", str(hf_dirs["gqa_tied_f32"]), "--dst",
                     str(tmp_path / "o"), "--json")
    assert code == 0 and json.loads(out.out)["tensors"] == 20
    code, out = _cli(monkeypatch, capfd, "convert", "hf2ms", "--src", str(hf_dirs["gqa_tied_f32"]), "--dst",
                     str(tmp_path / "o"), "--json")
    assert code == 2 and json.loads(out.out)["ok"] is False and "already exists" in out.err
    code, out = _cli(monkeypatch, capfd, "convert", "ms2hf", "--src", str(tmp_path / "o"), "--dst",
                     str(tmp_path / "h"), "--json")
    assert code == 0 and json.loads(out.out)["bit_exact_to_source"] is True


def test_cli_show_mapping(monkeypatch, capfd):
    code, out = _cli(monkeypatch, capfd, "convert", "hf2ms", "--show-mapping")
    assert code == 0 and "model.layers.{i}.self_attn.q_proj.weight" in out.out and "attention.wq" in out.out
    code, out = _cli(monkeypatch, capfd, "convert", "hf2ms", "--show-mapping", "--json")
    assert len(json.loads(out.out)["mapping"]) == len(mapping.MAPPING)
