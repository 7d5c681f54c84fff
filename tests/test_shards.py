"""Sharded checkpoints of the hand-written layouts (labkit.byhand.shards, reshard, ckpt_commands).

Fast: a full state with random moments cut for a layout's ranks, written as MindSpore files, read back and merged
by hand and by MindSpore's transform_checkpoints to the same full state, bit for bit; the strategy files parsed by
MindSpore's own functions; the rank numbering MindSpore assumes; bad inputs refused with nothing written.
Slow (the layouts' launches, cached by content): every layout's final checkpoint merges to the run's gathered
weights; the resumes under another layout equal the uninterrupted run; the merged model loads in transformers."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from labkit.byhand import ckpt_commands, reshard, runs, shards
from labkit.errors import LabkitError
from labkit.model import scratch
from labkit.training.checkpoint import file_digest

LAYOUTS = runs.layouts()
CFG = runs.model_cfg()


@pytest.fixture(scope="module")
def state():
    weights = scratch.init(CFG, 7)
    rng = np.random.default_rng(0)
    return {"weights": weights, "step": 2, "samples": 16,
            "adam_m": {n: rng.normal(size=a.shape).astype(np.float32) for n, a in weights.items()},
            "adam_v": {n: rng.random(size=a.shape).astype(np.float32) for n, a in weights.items()}}


@pytest.fixture(scope="module")
def saved(state, tmp_path_factory):
    """A layout's checkpoint of `state`, written once per layout name."""
    root, done = tmp_path_factory.mktemp("shards"), {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = reshard.write(root / name, state, CFG, LAYOUTS[name])
        return done[name]
    return get


def same(a: dict, b: dict) -> bool:
    return all(a["step"] == b["step"] and sorted(a[k]) == sorted(b[k])
               and all(np.array_equal(a[k][n], b[k][n]) for n in a[k]) for k in ("weights", "adam_m", "adam_v"))


def test_rank_numbering_is_stage_major_for_mindspore():
    for lay in LAYOUTS.values():
        assert sorted(shards.ms_rank(lay, r) for r in range(lay.workers)) == list(range(lay.workers))
        assert all(shards.hand_rank(lay, shards.ms_rank(lay, r)) == r for r in range(lay.workers))
    # dp2_pp2: hand ranks (dp outermost) 0 1 2 3 = (dp0 s0) (dp0 s1) (dp1 s0) (dp1 s1); MindSpore's stage 0 = 0, 1
    assert [shards.ms_rank(LAYOUTS["dp2_pp2"], r) for r in range(4)] == [0, 2, 1, 3]
    lay = LAYOUTS["dp2_tp2_pp2"]
    assert [lay.place(shards.hand_rank(lay, k)).pp for k in range(8)] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("name", ["dp2", "sp2", "pp2_1f1b", "zero2", "opt3", "cp2_ulysses", "dp2_pp2",
                                  "dp2_tp2_pp2"])
def test_merge_by_hand_and_by_mindspore_give_the_state(name, state, saved, tmp_path):
    ckpt = reshard.read(saved(name))
    assert (ckpt.step, ckpt.samples, ckpt.layout) == (2, 16, LAYOUTS[name])
    assert same(reshard.merge(ckpt), state)
    assert same(reshard.merge_with_mindspore(ckpt, tmp_path), state)


@pytest.mark.slow  # every layout's real shards merge in the slow tests below; this is the same for synthetic state
def test_every_layout_cuts_and_merges_back(state, saved):
    for name in LAYOUTS:
        assert same(reshard.merge(reshard.read(saved(name))), state), name


def test_mindspore_parses_the_strategy_files(saved, tmp_path):
    from mindspore.parallel import build_searched_strategy, merge_pipeline_strategys, rank_list_for_transform

    root = saved("dp2_tp2_pp2")
    one = build_searched_strategy(str(root / "strategy" / "ckpt_strategy_rank_0.ckpt"))
    assert list(one["model.layers.0.attention.wq.weight"].dev_matrix[0].dim) == [2, 1, 2]
    assert list(one["model.layers.0.attention.wq.weight"].tensor_map[0].dim) == [0, -1]
    assert list(one["model.layers.0.attention.wo.weight"].tensor_map[0].dim) == [-1, 0]
    merged = tmp_path / "merged.ckpt"
    merge_pipeline_strategys(str(root / "strategy"), str(merged))
    both = build_searched_strategy(str(merged))
    assert "0-model.tok_embeddings.embedding_weight" in both and "1-lm_head.weight" in both
    # the merged rank 0 needs one tp slice of each stage: MindSpore ranks {0, 1} and {4, 5} (stage-major)
    assert sorted(rank_list_for_transform(0, str(merged), None)) == [0, 1, 4, 5]
    zero = build_searched_strategy(str(saved("zero1") / "strategy" / "ckpt_strategy_rank_1.ckpt"))
    flat = zero["adam_m." + shards.FLAT.format(0)]
    assert (flat.opt_weight_shard_size, flat.opt_weight_shard_step, list(flat.tensor_map[0].dim)) == (2, 1, [-1])


def test_hand_rank_folders_break_mindspores_merge(saved, state, tmp_path):
    """The rank mapping matters: dp2_pp2's shards in folders by hand rank are not what MindSpore reads."""
    src = tmp_path / "by_hand_rank"
    shutil.copytree(saved("dp2_pp2"), src)
    lay = LAYOUTS["dp2_pp2"]
    for k in range(4):
        (src / f"rank_{k}").rename(src / f"tmp_{shards.hand_rank(lay, k)}")
    for r in range(4):
        (src / f"tmp_{r}").rename(src / f"rank_{r}")
    with pytest.raises(Exception):  # noqa: B017  MindSpore finds stage 1's tensors under a stage-0 rank
        merged = reshard.mindspore_merge(src, tmp_path / "work")
        tensors = reshard.read_ckpt(merged)
        assert np.array_equal(tensors["lm_head.weight"], state["weights"]["lm_head.weight"])
        raise AssertionError("merged although the ranks are misnumbered")


def test_cli_inspect_merge_reshard(saved, state, tmp_path, capfd):
    from labkit import cli

    assert cli.main(["ckpt", "inspect", str(saved("dp2_pp2")), "--json"]) == 0
    got = json.loads(capfd.readouterr().out)
    assert got["layout"]["name"] == "dp2_pp2" and got["step"] == 2 and got["loss_scale"]["kind"] == "none"
    assert [(r["ms_rank"], r["hand_rank"], r["stage"]) for r in got["ranks"]] == [(0, 0, 0), (1, 2, 0), (2, 1, 1),
                                                                                  (3, 3, 1)]
    assert got["ranks"][2]["tensors"]["lm_head.weight"] == [CFG.vocab_size, CFG.hidden_size]
    for tool in ("lab", "mindspore"):
        assert cli.main(["ckpt", "merge", str(saved("opt2")), "--out", str(tmp_path / tool), "--tool", tool]) == 0
        assert same(reshard.merge(reshard.read(tmp_path / tool)), state)
    capfd.readouterr()
    assert cli.main(["ckpt", "merge", str(saved("tp2")), "--out", str(tmp_path / "m"), "--hf", str(tmp_path / "hf"),
                     "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["hf"] == str(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (CFG.hidden_size, CFG.num_layers)
    assert cli.main(["ckpt", "reshard", str(saved("zero1")), "--to", "dp2_tp2_pp2", "--out",
                     str(tmp_path / "r")]) == 0
    again = reshard.read(tmp_path / "r")
    assert again.layout == LAYOUTS["dp2_tp2_pp2"] and same(reshard.merge(again), state)


def test_merge_mindformers_style_shards_with_mindspore(saved, state, tmp_path):
    """A cluster run's folder: rank_*/ checkpoints and per-stage strategy files, none of the lab's records."""
    src = tmp_path / "cluster"
    shutil.copytree(saved("dp2_tp2_pp2"), src, ignore=shutil.ignore_patterns("*.json"))
    shutil.move(src / "strategy", tmp_path / "strategy")
    with pytest.raises(LabkitError, match="strategy"):
        ckpt_commands.merge(src, tmp_path / "no", tool="mindspore")
    assert not (tmp_path / "no").exists()
    r = ckpt_commands.merge(src, tmp_path / "out", tool="mindspore", strategy=tmp_path / "strategy")
    assert r["records"] is False
    merged = reshard.read_ckpt(tmp_path / "out" / "merged.ckpt")
    for n, a in state["weights"].items():
        assert np.array_equal(merged[n], a) and np.array_equal(merged["adam_v." + n], state["adam_v"][n])
    with pytest.raises(LabkitError, match="--model"):  # HF needs the model, which such shards do not record
        ckpt_commands.merge(src, tmp_path / "no", tool="mindspore", strategy=tmp_path / "strategy",
                            hf=tmp_path / "no_hf")
    assert not (tmp_path / "no").exists() and not (tmp_path / "no_hf").exists()
    from labkit import cli

    # the end of a cluster run in one command: its shards merged, its weights to HF with the model's preset
    assert cli.main(["ckpt", "merge", str(src), "--tool", "mindspore", "--strategy", str(tmp_path / "strategy"),
                     "--model", CFG.name, "--out", str(tmp_path / "out2"), "--hf", str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file

    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    assert np.array_equal(hf["model.layers.1.mlp.down_proj.weight"],
                          state["weights"]["model.layers.1.feed_forward.w2.weight"])


# ------------------------------------------------------------------------------------------ bad input


def _copy(saved, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"in_{name}"
    shutil.copytree(saved(name), dst)
    for f in dst.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    return dst


def _refused(src: Path, out: Path, match: str, *, to: str = "dp2"):
    with pytest.raises(LabkitError) as e:
        ckpt_commands.reshard_to(src, to, out)
    assert e.value.fix  # a fix is always said
    assert re.search(match, str(e.value)), str(e.value)
    assert not out.exists() and not list(out.parent.glob(f".tmp-{out.name}*"))
    return str(e.value)


def test_missing_rank_is_refused(saved, tmp_path):
    src = _copy(saved, "dp2_tp2", tmp_path)
    shutil.rmtree(src / "rank_2")
    _refused(src, tmp_path / "out", r"rank_2: rank 2's shard is missing .*\n  fix: copy rank_2/")


def test_two_steps_are_refused(saved, state, tmp_path):
    src = _copy(saved, "tp2", tmp_path)
    later = reshard.write(tmp_path / "step5", {**state, "step": 5, "samples": 40}, CFG, LAYOUTS["tp2"])
    shutil.rmtree(src / "rank_1")
    shutil.copytree(later / "rank_1", src / "rank_1")  # rank 1's folder of another step
    _refused(src, tmp_path / "out", r"shards of different steps: rank 0 at step 2, rank 1 \(rank_1/shard_1.ckpt\) "
                                    r"at step 5")


def test_strategy_that_does_not_match_is_refused(saved, tmp_path):
    src = _copy(saved, "tp2", tmp_path)
    shutil.copy(saved("dp2") / "strategy" / "ckpt_strategy_rank_0.ckpt",
                src / "strategy" / "ckpt_strategy_rank_0.ckpt")  # a dp2 strategy: every tensor whole
    rec = src / "rank_0" / "shard_0.json"  # its digest recorded, so that only the shapes disagree
    d = json.loads(rec.read_text())
    d["files"]["strategy"].update(file_digest(src / "strategy" / "ckpt_strategy_rank_0.ckpt"))
    rec.write_text(json.dumps(d))
    _refused(src, tmp_path / "out", r"ckpt_strategy_rank_0.ckpt: '.*' cut by this strategy is \[\d+(, \d+)?\], "
                                    r"but rank 0's shard holds")


def test_target_that_does_not_divide_is_refused(saved, tmp_path):
    msg = _refused(saved("dp2"), tmp_path / "out", r"layout 'tp3' cannot hold .*tensor parallel 3 does not divide",
                   to="tp3")
    assert "out" in msg
    _refused(saved("dp2"), tmp_path / "out", r"3 stages for 2 layers", to="pp3")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_shard_is_refused(damage, saved, tmp_path):
    src = _copy(saved, "zero2", tmp_path)
    f = src / "rank_1" / "shard_1.ckpt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    else:
        data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    _refused(src, tmp_path / "out", r"rank_1/shard_1.ckpt: damaged: .* where its record says .*\n  fix: copy the "
                                    r"file again")


def test_merge_of_a_bad_checkpoint_writes_nothing(saved, tmp_path):
    src = _copy(saved, "dp2", tmp_path)
    shutil.rmtree(src / "rank_0")
    for tool in ("lab", "mindspore"):
        with pytest.raises(LabkitError, match="rank 0's shard is missing"):
            ckpt_commands.merge(src, tmp_path / tool, tool=tool)
        assert not (tmp_path / tool).exists()


# ------------------------------------------------------------------------------------------ the launches (slow)


@pytest.fixture(scope="module")
def launches():
    from labkit.course import parallel_lab

    return parallel_lab.parallel_runs("auto")


def _final(root: Path, name: str) -> Path:
    return next(root.glob(f"workers*/{name}/ckpt/step_{runs.SETTINGS['steps']}"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_final_checkpoint_merges_to_the_gathered_weights(name, launches, tmp_path):
    from labkit.course import parallel_lab

    want = parallel_lab.gathered(parallel_lab.load(launches, name))
    ckpt = reshard.read(_final(launches, name))
    assert (ckpt.step, ckpt.samples, ckpt.layout) == (3, 3 * runs.SETTINGS["global_batch"], LAYOUTS[name])
    by_hand, by_mindspore = reshard.merge(ckpt), reshard.merge_with_mindspore(ckpt, tmp_path)
    assert sorted(by_hand["weights"]) == sorted(want)
    for n, a in want.items():
        assert np.array_equal(by_hand["weights"][n], a), n
        assert np.array_equal(by_mindspore["weights"][n], a), n
    assert same(by_hand, by_mindspore)
    assert by_hand["step"] == 3 and all(np.abs(m).max() > 0 for m in by_hand["adam_m"].values())


@pytest.fixture(scope="module")
def resumed(launches):
    from labkit.course import parallel_lab

    return parallel_lab.resumed(launches)


@pytest.mark.slow
@pytest.mark.parametrize("name", [r.name for rs in runs.RESUMES.values() for r in rs])
def test_resume_under_another_layout_equals_the_uninterrupted_run(name, resumed):
    row, tol = resumed["resumes"][name], resumed["tolerance"]
    assert row["steps"] == runs.SETTINGS["steps"] - runs.RESUME_AT
    if name.endswith("_moments_reset"):  # the same resume with the moments zeroed: the test can fail
        assert row["weight_diff"] > 10 * tol["weight"] and row["loss_diff"] > tol["loss"], row
        assert not row["equal"]
    else:
        assert row["loss_diff"] <= tol["loss"] and row["weight_diff"] <= tol["weight"], (row, tol)


@pytest.mark.slow
def test_merged_checkpoint_loads_in_transformers_with_the_same_loss(launches, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from labkit.data.dataset import ensure_dataset
    from labkit.data.loader import make_loader

    state = reshard.merge(reshard.read(_final(launches, "dp2_tp2_pp2")))
    hf = reshard.to_hf(state, CFG, tmp_path / "hf", tmp_path)
    ids = next(make_loader(ensure_dataset(runs.SETTINGS["seq_len"], progress=False), 4, seed=5))
    tokens, labels, mask = (t.asnumpy() for t in scratch.split_batch(ids, CFG.pad_token_id))
    import mindspore as ms

    logits = scratch.logits({n: ms.Tensor(a) for n, a in state["weights"].items()}, ms.Tensor(tokens), CFG,
                            CFG.pad_token_id).asnumpy().astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    ours = -(np.take_along_axis(logp, labels[..., None], -1)[..., 0] * mask).sum() / mask.sum()
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask))
    lp = torch.log_softmax(out.logits.double(), -1).numpy()
    theirs = -(np.take_along_axis(lp, labels[..., None], -1)[..., 0] * mask).sum() / mask.sum()
    assert abs(ours - theirs) < 1e-4 * ours, (ours, theirs)


def test_mindspores_other_offline_tools_run_on_cpu(saved, state, tmp_path):
    """Every offline checkpoint function of mindspore.parallel runs on the CPU build with these files, and each
    merges to the same full tensors (MindSpore 2.9.0)."""
    import mindspore as ms
    from mindspore import nn, parallel
    from safetensors.numpy import load_file

    src, full = saved("dp2_tp2_pp2"), state["weights"]
    strategy = tmp_path / "strategy.ckpt"
    parallel.merge_pipeline_strategys(str(src / "strategy"), str(strategy))
    files = {k: str(src / f"rank_{k}" / f"shard_{k}.ckpt") for k in range(8)}
    needed = parallel.rank_list_for_transform(0, str(strategy), None)
    for tool in (parallel.transform_checkpoint_by_rank, parallel.convert_checkpoint_by_rank):
        out = tmp_path / f"{tool.__name__}.ckpt"
        tool(0, {k: files[k] for k in needed}, str(out), str(strategy), None)
        assert all(np.array_equal(reshard.read_ckpt(out)[n], a) for n, a in full.items()), tool.__name__
    parallel.convert_checkpoints(str(src), str(tmp_path / "conv"), "c_", str(strategy), None)
    got = reshard.read_ckpt(tmp_path / "conv" / "rank_0" / "c_0.ckpt")
    assert all(np.array_equal(got[n], a) for n, a in full.items())
    # merge_sliced_parameter: one tensor's slices in rank order, its strategy from the stage's file
    name = "model.layers.1.feed_forward.w2.weight"  # row parallel, stage 1: MindSpore ranks 4-7, tp innermost
    layouts = {k.split("-", 1)[1]: v for k, v in ms.build_searched_strategy(str(strategy)).items()}
    sliced = [ms.load_checkpoint(files[k])[name] for k in range(4, 8)]
    assert np.array_equal(parallel.merge_sliced_parameter(sliced, layouts).asnumpy(), full[name])
    # safetensors: the shards converted by ms.ckpt_to_safetensors, then unified_safetensors
    st = tmp_path / "st"
    for k in range(8):
        (st / f"rank_{k}").mkdir(parents=True)
        ms.ckpt_to_safetensors(files[k], str(st / f"rank_{k}"))
    parallel.unified_safetensors(str(st), str(strategy), str(tmp_path / "unified"))
    unified = {}
    for f in (tmp_path / "unified").glob("*.safetensors"):
        unified.update(load_file(f))
    assert all(np.array_equal(unified[n], a) for n, a in full.items())
    assert np.array_equal(unified["adam_m.lm_head.weight"], state["adam_m"]["lm_head.weight"])

    class Net(nn.Cell):  # a network holding two of the weights, whole (no predict strategy: one card)
        def __init__(self):
            super().__init__()
            self.wq = ms.Parameter(ms.Tensor(np.zeros((256, 256), np.float32)),
                                   name="model.layers.0.attention.wq.weight")
            self.head = ms.Parameter(ms.Tensor(np.zeros((CFG.vocab_size, 256), np.float32)), name="lm_head.weight")

    net = Net()  # it counts the training devices as the device matrix's product: one stage's, so no pipeline
    with pytest.raises(ValueError, match="the length of 'checkpoint_filenames' should be equal to the device count "
                                         "of training process. But got the length of 'checkpoint_filenames' is 8 "
                                         "and the device count is 4"):
        parallel.load_distributed_checkpoint(net, [files[k] for k in range(8)], None, str(strategy))
    one = saved("dp2_tp2")
    parallel.load_distributed_checkpoint(net, [str(one / f"rank_{k}" / f"shard_{k}.ckpt") for k in range(4)], None,
                                         str(one / "strategy" / "ckpt_strategy_rank_0.ckpt"))
    assert np.array_equal(net.wq.asnumpy(), full["model.layers.0.attention.wq.weight"])
    assert np.array_equal(net.head.asnumpy(), full["lm_head.weight"])


def test_a_cluster_runs_model_is_a_preset_or_its_run_yaml(tmp_path):
    """--model for shards without records: the preset, or the run.yaml notebook 07 wrote for the run (beside the
    mindformers.yaml of the same run) - the same 7B either way; a missing file is named."""
    from labkit.config import model_preset
    from labkit.course import pretrain

    run = pretrain.resolve({"preset": "llama2_7b", "output_dir": str(tmp_path / "run")})
    from_yaml = ckpt_commands.model_named(str(pretrain.write_configs(run)["run.yaml"]))
    preset = model_preset("llama2_7b")
    assert scratch.shapes(from_yaml) == scratch.shapes(preset)
    with pytest.raises(LabkitError, match="no such file"):
        ckpt_commands.model_named(str(tmp_path / "none.yaml"))


@pytest.mark.slow
def test_mindformers_own_merge_script_gives_the_same_weights(saved, state, tmp_path):
    """The post-run command docs/multinode.md gives beside `labkit ckpt merge`: mindformers 1.9's
    tools/ckpt_transform/transform_checkpoint.py (its own process, on the CPU build) on shards laid out as a
    mindformers run lays them, merged to one rank."""
    import subprocess
    import sys

    src = tmp_path / "output" / "checkpoint"
    shutil.copytree(saved("dp2_tp2_pp2"), src, ignore=shutil.ignore_patterns("*.json"))
    shutil.move(src / "strategy", tmp_path / "output" / "strategy")
    done = subprocess.run([sys.executable, "-m", "mindformers.tools.ckpt_transform.transform_checkpoint",
                           "--src_checkpoint", str(src), "--src_strategy", str(tmp_path / "output" / "strategy"),
                           "--dst_checkpoint_dir", str(tmp_path / "merged"), "--prefix", "llama2_7b"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    files = list((tmp_path / "merged").rglob("rank_0/*.ckpt"))
    assert len(files) == 1, files
    merged = reshard.read_ckpt(files[0])
    for n, a in state["weights"].items():
        assert np.array_equal(merged[n], a) and np.array_equal(merged["adam_m." + n], state["adam_m"][n])
