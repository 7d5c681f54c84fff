"""Every pair of artefacts checked before use (labkit.training.run_dir, labkit.weights.pairs): weights against a
model config, a tokenizer against a vocabulary, a dataset against seq_len and its tokenizer, a resumed checkpoint
against the config. No framework and no real training: checkpoints are written with labkit's own streaming
writer (the same bytes MindSpore writes), datasets are a stats.json. The same refusals through the command line
are rows of tests/test_bad_inputs.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from labkit.config import load_run_config, to_dict
from labkit.errors import LabkitError
from labkit.weights import formats, pairs
from labkit.weights.name_map import ms_shapes
from labkit.training import run_dir

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TOK = ROOT / "data" / "tokenizer"
SMALL = ["model.vocab_size=64", "model.hidden_size=16", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=32"]  # head_dim 8: heads 2/kv 1 and heads 4/kv 2 give the same shapes


def cfg_of(*sets, out="runs/x"):
    return load_run_config("configs/tiny_cpu.yaml", [*SMALL, f"output_dir={out}", *sets])


def write_ckpt(path: Path, model_cfg, dtype="float32", state=True, loss_scale=False, drop=(), monkeypatch=None):
    """A MindSpore checkpoint of `model_cfg`'s weights (zeros); with `state` also AdamW moments and an int32
    global_step, as labkit train writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = formats.CkptWriter(path)
    for name, shape in ms_shapes(model_cfg).items():
        if name not in drop:
            w.write(name, np.zeros(shape, formats.STORE[dtype]), dtype)
            if state:
                w.write(f"adam_m.{name}", np.zeros(shape, np.float32), "float32")
    if loss_scale:
        w.write("loss_scale.value", np.ones(1, np.float32), "float32")
    if state:
        monkeypatch.setitem(formats._MS_TAG, "int32", "Int32")
        w.write("global_step", np.array([2], np.int32), "int32")
    w.close()
    return path


def fake_run(out: Path, cfg, monkeypatch, step=2, global_batch=8, **ckpt):
    """A run folder as labkit train leaves it: config.yaml and checkpoints/step_N/{state.ckpt,state.json}."""
    ck = out / "checkpoints" / f"step_{step:06d}"
    write_ckpt(ck / "state.ckpt", cfg.model_config(), monkeypatch=monkeypatch, **ckpt)
    record = json.loads(json.dumps(to_dict(cfg), default=str))
    (ck / "state.json").write_text(json.dumps({"kind": "full", "step": step, "global_batch": global_batch,
                                               "config": record}))
    (out / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return ck


def fake_dataset(d: Path, **stats) -> Path:
    d.mkdir(parents=True)
    (d / "stats.json").write_text(json.dumps({"format": "labkit-dataset/1", "seq_len": 128, "vocab_size": 64,
                                              "eos_id": 2, "n_samples": 100, "files": {},
                                              "tokenizer": str(SHIPPED_TOK), **stats}))
    return d


def resume(out, cfg, **kw):
    return run_dir.check_run_folder(out, resume=True, overwrite=False, steps=cfg.train.steps,
                                    fit=run_dir.ResumeFit(cfg, **kw))


# ------------------------------------------------------------------------------ weights against a model


def test_the_index_lists_a_training_state_with_its_integer_counter(tmp_path, monkeypatch):
    p = write_ckpt(tmp_path / "state.ckpt", cfg_of().model_config(), monkeypatch=monkeypatch)
    with pytest.raises(LabkitError, match="'global_step' has dtype Int32"):
        formats.ckpt_index(p)
    index = formats.ckpt_index(p, any_dtype=True)
    assert index["global_step"].dtype == "int32"
    assert set(formats.model_entries(index)) == set(ms_shapes(cfg_of().model_config()))


def test_mismatch_names_the_key_both_values_and_a_tensor(tmp_path, monkeypatch):
    index = formats.ckpt_index(write_ckpt(tmp_path / "a.ckpt", cfg_of().model_config(), state=False))
    assert pairs.model_mismatch(index, cfg_of().model_config()) is None
    wider = cfg_of("model.hidden_size=32").model_config()
    assert pairs.model_mismatch(index, wider) == ("has model.hidden_size 16 (model.tok_embeddings.embedding_weight "
                                                    "[64, 16]), the config asks for 32")
    said = pairs.model_mismatch(index, cfg_of("model.num_layers=3").model_config())
    assert said.startswith("has model.num_layers 2 (model.layers.1.*), the config asks for 3")
    said = pairs.model_mismatch(index, cfg_of("model.tie_word_embeddings=true").model_config())
    assert said.startswith("has model.tie_word_embeddings False (lm_head.weight [64, 16])")
    # num_heads does not show in the shapes (head_dim 8 either way): the recorded config says it
    heads = cfg_of("model.num_heads=4", "model.num_kv_heads=2").model_config()
    assert pairs.model_mismatch(index, heads) is None
    assert pairs.model_mismatch(index, heads, source=cfg_of().model_config()) == (
        "has model.num_heads 2, the config asks for 4; also model.num_kv_heads 1 vs 2")


def test_check_weights_refuses_missing_tensors_and_other_dtypes(tmp_path):
    m = cfg_of().model_config()
    gap = formats.ckpt_index(write_ckpt(tmp_path / "gap.ckpt", m, state=False, drop=("model.norm_out.weight",)))
    with pytest.raises(LabkitError) as e:
        pairs.check_weights("w", gap, m, "the fix")
    assert (e.value.what, e.value.fix) == ("w holds no model.norm_out.weight", "the fix")
    half = formats.ckpt_index(write_ckpt(tmp_path / "half.ckpt", m, dtype="bfloat16", state=False))
    with pytest.raises(LabkitError, match=r"stores model.tok_embeddings.embedding_weight as bfloat16 \(21 tensors\), "
                                          r"the model's parameters are float32 \(O0\)") as e:
        pairs.check_weights("w", half, m, "shape fix", dtype=pairs.ParamDtype("float32", " (O0)", "dtype fix"))
    assert e.value.fix == "dtype fix"


# ---------------------------------------------------------------------------- tokenizers against models


def test_tokenizer_span_from_each_kind_of_vocabulary_file(tmp_path):
    assert pairs.tokenizer_span(SHIPPED_TOK) == (4096, "tokenizer.json")
    sp = tmp_path / "sp"
    sp.mkdir()
    shutil.copy(SHIPPED_TOK / "tokenizer.model", sp)
    assert pairs.tokenizer_span(sp) == (4096, "tokenizer.model")
    (sp / "added_tokens.json").write_text(json.dumps({"<extra>": 4100}))
    assert pairs.tokenizer_span(sp) == (4101, "tokenizer.model")
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    (bpe / "vocab.json").write_text(json.dumps({"a": 0, "b": 7}))
    assert pairs.tokenizer_span(bpe) == (8, "vocab.json")
    assert pairs.tokenizer_span(tmp_path) is None
    with pytest.raises(LabkitError, match=r"tokenizer .*bpe \(vocab.json\) has token ids up to 7, the model has "
                                          r"vocab_size 4 \(embedding rows 0..3\)"):
        pairs.check_tokenizer_fits(bpe, 4, "the model", "fix")
    assert pairs.check_tokenizer_fits(bpe, 8, "the model", "fix") == 8


def test_a_converted_directory_is_checked_against_its_model_yaml(tmp_path):
    m = cfg_of().model_config()
    d = tmp_path / "conv"
    write_ckpt(d / "model.ckpt", m, state=False)
    (d / "model.yaml").write_text(yaml.safe_dump(to_dict(m)))
    assert pairs.check_converted(d) == m
    shutil.copy(SHIPPED_TOK / "tokenizer.json", d)  # 4096 ids for 64 embedding rows
    with pytest.raises(LabkitError, match=r"tokenizer .*conv \(tokenizer.json\) has token ids up to 4095, .*model.yaml "
                                          r"has vocab_size 64") as e:
        pairs.check_converted(d)
    assert "resize-embeddings" in e.value.fix
    (d / "tokenizer.json").unlink()
    (d / "model.yaml").write_text(yaml.safe_dump(dict(to_dict(m), vocab_size=65)))
    with pytest.raises(LabkitError, match=r"model.ckpt has model.vocab_size 64 \(.*\), .*model.yaml asks for 65"):
        pairs.check_converted(d)


def test_init_checkpoint_weights_must_be_the_configs_model(tmp_path, monkeypatch):
    cfg = cfg_of()
    d = tmp_path / "conv"
    write_ckpt(d / "model.ckpt", cfg.model_config(), dtype="bfloat16", state=False)
    (d / "model.yaml").write_text(yaml.safe_dump(to_dict(cfg.model_config())))
    with pytest.raises(LabkitError, match=r"train.init_checkpoint .*model.ckpt stores .* as bfloat16 .*float32 "
                                          r"\(train.amp_level O0\)") as e:
        run_dir.check_init_checkpoint(d, cfg)
    assert "--dtype float32" in e.value.fix
    with pytest.raises(LabkitError, match=r"has model.hidden_size 16 .*, the config asks for 32") as e:
        run_dir.check_init_checkpoint(d, cfg_of("model.hidden_size=32"))
    assert "model.yaml" in e.value.fix
    bare = write_ckpt(tmp_path / "bare.ckpt", cfg.model_config(), state=False)
    assert run_dir.check_init_checkpoint(bare, cfg) == bare
    ck = fake_run(tmp_path / "run", cfg, monkeypatch)  # a training checkpoint: its state.json says num_heads
    assert run_dir.check_init_checkpoint(ck, cfg) == ck
    with pytest.raises(LabkitError, match="has model.num_heads 2, the config asks for 4"):
        run_dir.check_init_checkpoint(ck, cfg_of("model.num_heads=4", "model.num_kv_heads=2"))
    with pytest.raises(LabkitError, match="holds no weights"):
        run_dir.check_init_checkpoint(tmp_path, cfg)


# ------------------------------------------------------------------------------- datasets against configs


def test_dataset_special_tokens_and_tokenizer_vocabulary(tmp_path):
    ds = fake_dataset(tmp_path / "eos", eos_id=0)
    with pytest.raises(LabkitError, match=r"ends documents with token id 0 .*model's eos_token_id is 2") as e:
        run_dir.check_dataset(cfg_of(f"data.dataset={ds}"))
    assert "model.eos_token_id=0" in e.value.fix
    ds = fake_dataset(tmp_path / "v400", vocab_size=60)
    with pytest.raises(LabkitError, match=r"tokenized with 60 token ids .*data.tokenizer data/tokenizer has 4096") as e:
        run_dir.check_dataset(cfg_of(f"data.dataset={ds}"))
    assert "labkit data build --tokenizer data/tokenizer" in e.value.fix
    small = tmp_path / "tok60"
    small.mkdir()
    (small / "vocab.json").write_text(json.dumps({str(i): i for i in range(60)}))
    assert run_dir.check_dataset(cfg_of(f"data.dataset={ds}", f"data.tokenizer={small}")).n_samples == 100


# ------------------------------------------------------------------------------- resume against the config


def test_resume_refuses_another_model(tmp_path, monkeypatch):
    cfg = cfg_of(out=tmp_path / "run")
    ck = fake_run(tmp_path / "run", cfg, monkeypatch)
    assert resume(tmp_path / "run", cfg).checkpoint == ck
    with pytest.raises(LabkitError, match=rf"^checkpoint {ck} has model.hidden_size 16 \(model.tok_embeddings."
                                          r"embedding_weight \[64, 16\]\), the config asks for 32") as e:
        resume(tmp_path / "run", cfg_of("model.hidden_size=32", out=tmp_path / "run"))
    assert e.value.fix == (f"resume with the run's own model settings ({tmp_path / 'run' / 'config.yaml'}), or start "
                           "a new run with another --output")
    for key in ("model.num_heads=4", "model.rope_theta=500000", "model.pad_token_id=3"):
        sets = (key, "model.num_kv_heads=2") if "heads" in key else (key,)
        with pytest.raises(LabkitError, match=f"has model.{key.split('.')[1].split('=')[0]} "):
            resume(tmp_path / "run", cfg_of(*sets, out=tmp_path / "run"))
    (tmp_path / "run" / "config.yaml").write_text("model: {preset: small}\n")  # a later run rewrote it
    with pytest.raises(LabkitError) as e:
        resume(tmp_path / "run", cfg_of("model.hidden_size=32", out=tmp_path / "run"))
    assert f"the config in {ck / 'state.json'}" in e.value.fix
    with pytest.raises(LabkitError) as e:
        run_dir.check_run_folder(tmp_path / "run", resume=True, overwrite=False, steps=60, spelling=run_dir.PAPERMILL,
                                 fit=run_dir.ResumeFit(cfg_of("model.hidden_size=32", out=tmp_path / "run")))
    assert "another output_dir" in e.value.fix


def test_resume_may_change_schedule_cadence_and_the_batch_split(tmp_path, monkeypatch):
    cfg = cfg_of(out=tmp_path / "run")
    fake_run(tmp_path / "run", cfg, monkeypatch)
    ds = fake_dataset(tmp_path / "ds")
    free = cfg_of("train.steps=90", "train.lr=1e-3", "train.decay_steps=400", "train.save_every=5",
                  "train.eval_every=10", "train.kernels=native", "train.recompute=all", "train.micro_batch=4",
                  "train.accum=2", "model.max_position_embeddings=1024", out=tmp_path / "run")
    folder = resume(tmp_path / "run", free, global_batch=8)
    run_dir.check_resume_data(folder, free, dataset=run_dir.DatasetCheck(ds, 100, json.loads(
        (ds / "stats.json").read_text())), global_batch=8)


def test_resume_keeps_the_data_order_on_the_same_data(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = cfg_of(out=out)
    fake_run(out, cfg, monkeypatch)
    with pytest.raises(LabkitError, match="trained with train.seed 1234 on this dataset, the config asks for 7"):
        resume(out, cfg_of("train.seed=7", out=out))
    with pytest.raises(LabkitError, match="data.shuffle True"):
        resume(out, cfg_of("data.shuffle=false", out=out))
    with pytest.raises(LabkitError, match=r"global batch 8 on this dataset, the config gives 16 \(train.micro_batch 8 "
                                          r"x dp 2 x train.accum 1\)") as e:
        resume(out, cfg_of(out=out), global_batch=16)
    assert "micro_batch x dp x accum = 8" in e.value.fix
    # another dataset (a seq_len curriculum, notebook 08a): a new order there, the same tokenizer
    other = cfg_of("data.seq_len=64", "train.seed=7", "train.micro_batch=16", out=out)
    folder = resume(out, other, global_batch=16)
    tok = tmp_path / "tok"
    shutil.copytree(SHIPPED_TOK, tok)
    stats = {"tokenizer": str(tok), "seq_len": 64}
    run_dir.check_resume_data(folder, other, dataset=run_dir.DatasetCheck(tmp_path, 100, stats))  # same files
    (tok / "special_tokens_map.json").write_text("{}")
    with pytest.raises(LabkitError, match=rf"is tokenized with {tok}, checkpoint .* was trained on tokens of "
                                          rf"{SHIPPED_TOK}") as e:
        run_dir.check_resume_data(folder, other, dataset=run_dir.DatasetCheck(tmp_path, 100, stats))
    assert "labkit data build --tokenizer" in e.value.fix


def test_resume_keeps_the_weights_dtype_and_the_loss_scale_state(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fake_run(out, cfg_of(out=out), monkeypatch)
    with pytest.raises(LabkitError, match=r"holds no loss-scale state \(written with train.amp_level O0\), "
                                          "train.amp_level O2 needs it"):
        resume(out, cfg_of("train.amp_level=O2", out=out))
    with pytest.raises(LabkitError, match=r"stores .* as float32 \(21 tensors\), the model's parameters are float16 "
                                          r"\(train.amp_level O3\)"):
        resume(out, cfg_of("train.amp_level=O3", out=out))
    mixed = tmp_path / "mixed"
    fake_run(mixed, cfg_of("train.amp_level=O2", out=mixed), monkeypatch, loss_scale=True)
    for level in ("O0", "O1", "O2"):
        resume(mixed, cfg_of(f"train.amp_level={level}", out=mixed))


def test_a_checkpoint_from_another_labkit_is_still_checked_by_its_shapes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    ck = fake_run(out, cfg_of(out=out), monkeypatch)
    meta = json.loads((ck / "state.json").read_text())
    meta["config"]["train"]["retired_knob"] = 1
    (ck / "state.json").write_text(json.dumps(meta))
    resume(out, cfg_of("train.seed=7", out=out))  # the data order cannot be compared
    with pytest.raises(LabkitError, match="has model.hidden_size 16"):
        resume(out, cfg_of("model.hidden_size=32", out=out))


def test_generation_checks_the_weights_and_the_tokenizer(tmp_path, monkeypatch):
    cfg = cfg_of()
    ck = fake_run(tmp_path / "run", cfg, monkeypatch)
    small = tmp_path / "tok60"
    small.mkdir()
    (small / "vocab.json").write_text(json.dumps({str(i): i for i in range(60)}))
    run_dir.check_trained(ck, cfg, small)
    with pytest.raises(LabkitError, match=r"tokenizer .* has token ids up to 4095, checkpoint .* has vocab_size 64"):
        run_dir.check_trained(ck, cfg, SHIPPED_TOK)
    with pytest.raises(LabkitError, match=r"has model.hidden_size 16 \(.*\), its state.json asks for 32"):
        run_dir.check_trained(ck, cfg_of("model.hidden_size=32"), small)
    assert run_dir.same_tokenizer(SHIPPED_TOK, SHIPPED_TOK) and not run_dir.same_tokenizer(SHIPPED_TOK, small)


def test_notebook_07_resolve_checks_the_resumed_checkpoint(tmp_path, monkeypatch):
    from labkit.course import pretrain

    fake_run(tmp_path / "run", cfg_of(out=tmp_path / "run"), monkeypatch)  # a smaller model than preset tiny's
    with pytest.raises(LabkitError, match=r"has model.vocab_size 64 \(.*\), the config asks for 4096; also "
                                          r"model.hidden_size 16 vs 256") as e:
        pretrain.resolve({"output_dir": str(tmp_path / "run"), "resume": True, "steps": 4})
    assert "another output_dir" in e.value.fix  # papermill's spelling
