"""The planner: exact parameter counts (checked against mindformers), the memory and time model against their
sources, the search and its constraints, the CLI's JSON, the mindformers YAML it writes (checked offline by
mindformers itself). The CPU calibration (memory differences within the bench's target) is measured and asserted once,
by notebook 06c under nbval (it caches runs/bench/plan_calibration.json); tests/test_calibration.py tests the cache."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from labkit.parallel import planner as P
from labkit.parallel import memory
from labkit.model import shapes
from labkit.model.shapes import num_params
from labkit.parallel import mindformers_yaml as mf_yaml
from labkit.parallel import msrun
from labkit.config import ModelConfig, model_preset
from labkit.layout import Layout
from labkit.errors import LabkitError

NOFA = memory.Numerics(flash_attention=False)

ROOT = Path(__file__).resolve().parents[1]
LLAMA2_7B = 6_738_415_616


def _env():
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "GLOG_v": "3"}


def _cli(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "labkit", "plan", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def seven_b():
    return model_preset("llama2_7b")


@pytest.fixture(scope="module")
def plan8(seven_b):
    return P.plan(seven_b, P.Machine(8, 64))


def test_llama2_7b_count_matches_mindformers(seven_b):
    """The config's count is exact, and the same as the structure mindformers builds (without weights)."""
    from labkit.model.llama import build_model, count_parameters

    assert num_params(seven_b) == LLAMA2_7B
    counts = P.stage_params(seven_b)["only"]
    assert counts["params"] == LLAMA2_7B and counts["layers"] == 32
    model = build_model(seven_b, seq_length=4096, no_init=True)
    assert count_parameters(model) == LLAMA2_7B


def test_bytes_per_parameter_is_the_census_of_the_dtypes_asked_for():
    """The state census (what mindformers built) holds each level's weights in the dtype the YAML asked for
    (AMP_LEVELS' param_dtype), the accumulation buffer in the weights' dtype, AdamW's two moments in float32 whatever
    the weights; it was taken with the installed versions (a new MindSpore or mindformers needs a new census)."""
    from labkit.config import AMP_LEVELS
    from labkit.parallel import census

    states = census.load_states()
    assert states["versions"] == census.versions()
    for level, dtypes in AMP_LEVELS.items():
        size = memory.DTYPE_BYTES[dtypes["param_dtype"]]
        for wrapper in (memory.ONE_STEP, memory.PIPELINE):
            assert P.bytes_per_param(level, wrapper) == {"weights": size, "gradients": size, "optimizer": 8,
                                                         "total": 2 * size + 8}
            roles = states["cases"][f"{level}-{wrapper}"]["roles"]
            assert ("accu_grads" in roles) == (wrapper == memory.PIPELINE)
            assert roles["weights"]["norm"]["dtypes"] == [dtypes["norm_dtype"]]


def test_activations_follow_korthikanti():
    """Table 2 of Korthikanti et al. with Llama's tensors: selective drops the a*s^2 term, full keeps the layer
    input, tensor parallel splits all but the norms, sequence parallel splits those too."""
    cfg = ModelConfig(hidden_size=1024, num_heads=16, num_layers=4, vocab_size=1000, intermediate_size=4096)
    s, b = 2048, 2
    sbh, scores = s * b * 1024, 16 * s * s * b
    none = memory.layer_activations(cfg, s, b, numerics=NOFA)["stored"]
    assert none == pytest.approx(4 * sbh + 4 * sbh + 4 * s * b * 4096 + scores)  # norms, Q K V ctx, SwiGLU, scores
    sel = memory.layer_activations(cfg, s, b, recompute="selective", numerics=NOFA)
    assert sel["stored"] == pytest.approx(none - scores) and sel["working"] == pytest.approx(scores)
    assert memory.layer_activations(cfg, s, b, recompute="full")["stored"] == sbh
    fa = memory.layer_activations(cfg, s, b)["stored"]
    assert fa == pytest.approx(none - scores + 2 * 16 * s * b)  # flash attention keeps only row statistics
    tp = memory.layer_activations(cfg, s, b, mp=4, numerics=NOFA)["stored"]
    assert tp == pytest.approx(4 * sbh + (none - 4 * sbh) / 4)
    sp = memory.layer_activations(cfg, s, b, mp=4, sequence_parallel=True, numerics=NOFA)["stored"]
    assert sp == pytest.approx(none / 4)


def test_cpu_graph_terms():
    """Without fused RMSNorm / SiLU kernels (CPU), MindSpore computes some backward tensors during the forward pass
    and holds them to the peak: Square's 2*x per norm, SiLUGrad's Sigmoid(x) per layer. Against the calibration
    model's kernel graph (MindSpore 2.9, mindformers 1.9; live tensors replayed in launch order: 14.5 MiB per layer,
    34 MiB of final norm and loss at b=4, s=128, which the memory pool's peak confirms to its 1 MiB resolution)."""
    cfg = ModelConfig(hidden_size=256, num_heads=4, num_layers=2, vocab_size=4096)
    s, b, f = 128, 4, cfg.ffn_size
    sbh, scores, mib = s * b * 256, 4 * s * s * b, 2**20
    cpu = memory.Numerics(flash_attention=False, fused_norm=False, fused_silu=False)
    layer = memory.layer_activations(cfg, s, b, numerics=cpu)["stored"]
    assert layer == 12 * sbh + scores + 5 * s * b * f and layer * 4 / mib == 14.5
    # the layer input, and 2*x from it
    assert memory.layer_activations(cfg, s, b, recompute="full", numerics=cpu)["stored"] == 2 * sbh
    assert memory.loss_activations(cfg, s, b, act_bytes=4, fused_norm=False) / mib == 34  # 4 x s*b*h + 4 x s*b*vocab
    assert memory.recompute_mask_elements(s, b, "none", False) == 0 < memory.recompute_mask_elements(s, b, "full", False)
    assert memory.adamw_early_bytes(num_params(cfg)) == 4 * num_params(cfg)
    mem = P.memory_breakdown(cfg, Layout(micro_batch=b), seq_len=s,
                             numerics=dataclasses.replace(cpu, amp_level="O0"))
    assert mem["activations"] * 2**30 / mib == 2 * 14.5 + 34


def test_flops_per_token_matches_published(seven_b):
    """torchtitan/PaLM convention for Llama-2-7B at 4096: 46.09 GFLOP per token; full recompute adds a forward."""
    f = shapes.flops_per_token(seven_b, 4096)
    assert f["model"] / 1e9 == pytest.approx(46.09, abs=0.01)
    full = shapes.flops_per_token(seven_b, 4096, "full")
    assert 0.30 < full["hardware"] / full["model"] - 1 < 0.34


def test_plan_8_cards_finds_the_mindformers_recipe(plan8):
    """8 x 64 GiB: mindformers' own 7B recipe (dp 8, batch 1 x accum 8, no recompute, parallel optimizer, flash
    attention) fits, and it is the planner's first choice."""
    assert plan8["params"] == LLAMA2_7B and plan8["best"] is not None
    best = plan8["best"]
    assert (best.dp, best.mp, best.pp, best.micro_batch, best.accum, best.recompute,
            best.optimizer_shard) == (8, 1, 1, 1, 8, "none", True)
    assert best is plan8["strategies"][0] and best.fits
    tps = [r.tokens_per_s for r in plan8["strategies"] if r.fits]
    assert tps == sorted(tps, reverse=True)
    for r in plan8["strategies"]:
        assert r.dp * r.mp * r.pp * r.cp == 8 and r.dp * r.micro_batch * r.accum == 64
        m = r.memory_gib
        parts = m["weights"] + m["gradients"] + m["optimizer"] + m["copies"] + m["activations"] + m["overhead"]
        assert m["total"] == pytest.approx(parts, abs=0.01)
        assert r.fits == (m["total"] + P.FIT_MARGIN_GIB <= 64) and ((r.why_not is not None) != r.fits)


def test_plan_1_card_nothing_fits(seven_b):
    r = P.plan(seven_b, P.Machine(1, 64))
    assert r["best"] is None and r["strategies"] and not any(s.fits for s in r["strategies"])
    assert "75.3 GiB" in r["why"] and "devices" in r["why"]


def test_constraints_validate_a_chosen_strategy(seven_b):
    pinned = dict(dp=2, mp=2, pp=2, micro_batch=1, accum=32, recompute="selective", optimizer_shard=True)
    r = P.plan(seven_b, P.Machine(8, 64), constraints=pinned)
    assert len(r["strategies"]) == 1 and r["best"] == r["strategies"][0]
    assert {k: getattr(r["best"], k) for k in pinned} == pinned
    r = P.plan(seven_b, P.Machine(8, 64), constraints={"mp": 8, "pp": 1})
    assert r["strategies"] and all(s.mp == 8 for s in r["strategies"])
    r = P.plan(seven_b, P.Machine(8, 64), constraints={"mp": 3})
    assert r["best"] is None and "no valid strategy" in r["why"]
    with pytest.raises(LabkitError, match="unknown constraint"):
        P.plan(seven_b, P.Machine(8, 64), constraints={"tp": 2})
    with pytest.raises(LabkitError, match="recompute"):
        P.plan(seven_b, P.Machine(8, 64), constraints={"recompute": "some"})


def test_pipeline_bubble_and_micro_batch_rule(seven_b):
    r = P.plan(seven_b, P.Machine(8, 64),
               constraints={"dp": 1, "mp": 1, "pp": 8, "micro_batch": 1, "recompute": "none"})
    (row,) = r["strategies"]
    assert row.time_s["bubble"] == pytest.approx(row.time_s["compute"] * 7 / 64, rel=1e-3)
    r = P.plan(seven_b, P.Machine(8, 64), global_batch=4, constraints={"pp": 8})
    assert r["best"] is None and any("micro-batches >= stages" in k for k in r["skipped"])


def test_yaml_is_accepted_by_mindformers(plan8, seven_b):
    """The YAML the planner writes builds mindformers' own config objects and the 7B structure (offline)."""
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig, TransformerRecomputeConfig

    from labkit.model.llama import build_model, count_parameters

    pick = next(r for r in plan8["strategies"] if r.mp == 2 and r.pp == 2 and r.recompute == "selective")
    y = yaml.safe_load(mf_yaml.mindformers_parallel_yaml(pick.layout))
    assert y["parallel"]["parallel_mode"] == 1 and y["parallel_config"]["pipeline_stage"] == 2
    assert y["parallel_config"]["micro_batch_num"] == pick.accum and y["runner_config"]["batch_size"] == 1
    assert y["recompute_config"] == {**y["recompute_config"], "recompute": False, "select_recompute": True}
    pc = TransformerOpParallelConfig(recompute=TransformerRecomputeConfig(**y["recompute_config"]),
                                     **y["parallel_config"])
    assert (pc.data_parallel, pc.model_parallel, pc.pipeline_stage) == (pick.dp, 2, 2)
    assert count_parameters(build_model(seven_b, seq_length=4096, no_init=True, parallel_config=pc)) == LLAMA2_7B
    auto = yaml.safe_load(mf_yaml.mindformers_parallel_yaml(pick.layout, parallel_mode="auto_parallel",
                                                       search_mode="recursive_programming"))
    assert auto["parallel"]["parallel_mode"] == 2 and auto["parallel"]["search_mode"] == "recursive_programming"


@pytest.mark.slow
def test_mindformers_reads_the_planned_global_batch(plan8, tmp_path):
    """mindformers' own trainer code derives the global batch from the YAML: with and without pipeline stages
    (micro_batch_num against gradient_accumulation_steps), and a YAML edited by hand reads differently."""
    with_pp = next(r for r in plan8["strategies"] if r.pp > 1)
    without = next(r for r in plan8["strategies"] if r.pp == 1 and r.accum > 1)
    for i, pick in enumerate((with_pp, without)):
        f = tmp_path / f"plan{i}.yaml"
        f.write_text(mf_yaml.mindformers_parallel_yaml(pick.layout), encoding="utf-8")
        assert mf_yaml.mindformers_global_batch(f) == pick.micro_batch * pick.dp * pick.accum
    doc = yaml.safe_load(f.read_text(encoding="utf-8"))
    doc["runner_config"]["batch_size"] *= 3
    f.write_text(yaml.safe_dump(doc), encoding="utf-8")
    assert mf_yaml.mindformers_global_batch(f) == 3 * without.micro_batch * without.dp * without.accum


def _yaml_as_once_written(row: P.Strategy, parallel_mode: int, search_mode: str, sequence_parallel: bool) -> str:
    """The text mindformers_parallel_yaml wrote with f-strings before it became a mapping dumped by safe_dump."""
    b = lambda v: "True" if v else "False"  # noqa: E731
    s = row.layout.row()
    pipeline = s["pp"] > 1
    return f"""\
use_parallel: True
parallel:
  parallel_mode: {parallel_mode}  # 0 data, 1 semi-auto, 2 auto parallel
  gradients_mean: False
  enable_alltoall: False
  full_batch: True
  search_mode: "{search_mode}"  # used by auto_parallel only
  enable_parallel_optimizer: {b(s['optimizer_shard'])}  # shard optimizer states (and weights) over dp
  strategy_ckpt_save_file: "./ckpt_strategy.ckpt"
  parallel_optimizer_config:
    optimizer_level: level1
    parallel_optimizer_threshold: 64
    optimizer_weight_shard_size: -1
parallel_config:
  data_parallel: {s['dp']}
  model_parallel: {s['mp']}
  pipeline_stage: {s['pp']}
  context_parallel: 1
  use_seq_parallel: {b(sequence_parallel)}
  micro_batch_num: {s['accum'] if pipeline else 1}  # pipeline micro-batches per step (>= pipeline_stage)
  vocab_emb_dp: True
  gradient_aggregation_group: 4
micro_batch_interleave_num: 1
recompute_config:
  recompute: {b(s['recompute'] == 'full')}
  select_recompute: {b(s['recompute'] == 'selective')}
  parallel_optimizer_comm_recompute: False
  mp_comm_recompute: True
  recompute_slice_activation: True
runner_config:
  batch_size: {s['micro_batch']}  # per device and micro-step
  gradient_accumulation_steps: {1 if pipeline else s['accum']}
"""


@pytest.mark.slow
def test_yaml_mapping_equals_the_text_it_replaced(plan8):
    """Every planned strategy gives the same YAML document (parsed) as the f-string text did, key order included,
    and the written text parses back to the mapping (the text had no context parallelism: context_parallel 1 is the
    one key added since; cp > 1 is tests/test_cp_terms.py's)."""
    for row in (r for r in plan8["strategies"] if r.cp == 1):
        for mode, number in mf_yaml.PARALLEL_MODES.items():
            for search, seq_par in (("sharding_propagation", False), ("recursive_programming", True)):
                options = dict(parallel_mode=mode, search_mode=search)
                layout = dataclasses.replace(row.layout, sequence_parallel=seq_par)
                doc = mf_yaml.mindformers_parallel_config(layout, **options)
                old = yaml.safe_load(_yaml_as_once_written(row, number, search, seq_par))
                assert doc == old and list(doc) == list(old)
                assert yaml.safe_load(mf_yaml.mindformers_parallel_yaml(layout, **options)) == doc
    with pytest.raises(LabkitError, match="search_mode 'greedy'"):
        mf_yaml.mindformers_parallel_config(plan8["best"].layout, search_mode="greedy")


def test_msrun_command(plan8):
    best = plan8["best"].layout
    assert msrun.msrun_command(best).startswith("msrun --worker_num=8 --local_worker_num=8 --master_port=8118")
    two = msrun.msrun_command(dataclasses.replace(best, dp=16), nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert "--worker_num=16 --local_worker_num=8 --master_addr=10.0.0.1 --node_rank=1" in two
    with pytest.raises(LabkitError):
        msrun.msrun_command(best, nodes=3)


def test_cli_json_8_and_1_devices():
    code, out, err = _cli("--preset", "llama2_7b", "--devices", "8", "--device-memory", "64", "--json")
    assert code == 0, err
    data = json.loads(out)  # exactly one JSON object on stdout
    assert data["params"] == LLAMA2_7B and data["best"] in data["strategies"]
    row = data["strategies"][0]
    for key in ("dp", "mp", "pp", "micro_batch", "accum", "recompute", "optimizer_shard", "memory_gib",
                "step_time_s", "tokens_per_s", "fits"):
        assert key in row
    assert {"total", "weights", "gradients", "optimizer", "activations", "overhead"} <= set(row["memory_gib"])
    assert "msrun --worker_num=8" in data["msrun"] and "parallel_config:" in data["mindformers_yaml"]
    code, out, _ = _cli("--preset", "llama2_7b", "--devices", "1", "--device-memory", "64", "--json")
    data = json.loads(out)
    assert code == 0 and data["best"] is None and "nothing fits" in data["why"]
    assert all(not r["fits"] and r["why_not"] for r in data["strategies"])


def test_cli_config_file_and_errors(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n  num_layers: 6\ndata:\n  seq_len: 256\ntrain:\n  steps: 3\n")
    code, out, err = _cli("--config", str(cfg), "--devices", "2", "--device-memory", "1", "--device", "a100_80g",
                          "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["seq_len"] == 256 and data["params"] == num_params(model_preset("tiny", num_layers=6))
    cfg.write_text("model:\n  preset: tiny\n  layers: 6\n")
    code, out, _ = _cli("--config", str(cfg), "--devices", "2", "--device-memory", "1", "--json")
    data = json.loads(out)
    assert code == 2 and not data["ok"] and "layers" in data["error"]
    code, out, _ = _cli("--preset", "llama2_7b", "--devices", "8", "--device-memory", "64", "--device", "tpu",
                        "--json")
    assert code == 2 and "unknown device preset" in json.loads(out)["error"]


def test_human_table():
    code, out, _ = _cli("--preset", "llama2_7b", "--devices", "8", "--device-memory", "64", "--top", "5")
    assert code == 0 and "tok/s/dev" in out and "msrun --worker_num=8" in out and "more (--top N" in out

