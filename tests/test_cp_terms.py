"""Context parallelism (labkit.parallel.cp_terms and its users): the layout's cp and algorithm, the config
keys and their refusals, the memory and communication terms against their formulas, the planner's search over cp,
the mindformers keys written and read back (and accepted by mindformers' own classes), `labkit plan --cp`, and the
Llama-2-7B-at-32k table of notebook 07."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from labkit.config import ParallelConfig, RunConfig, load, load_run_config, model_preset
from labkit.errors import LabkitError
from labkit.layout import CP_ALGOS, Layout
from labkit.parallel import cp_terms as C
from labkit.parallel import memory
from labkit.parallel import mindformers_yaml as mf_yaml
from labkit.parallel import planner as P

FA = memory.Numerics(amp_level="fp16", flash_attention=True)
SEVEN_B = model_preset("llama2_7b")
MF_7B = "configs/llama2_7b_mindformers.yaml"
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
           "GLOG_v": "3"}
    proc = subprocess.run([sys.executable, "-m", "labkit", "plan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_layout_counts_cp_in_its_devices_and_names_the_ring_and_ulysses_parts():
    lay = Layout(dp=2, mp=2, cp=4, cp_algo="hybrid_cp", ulysses_degree=2)
    assert lay.devices == 16 and (lay.ulysses, lay.ring) == (2, 2)
    assert (Layout(cp=4).ulysses, Layout(cp=4).ring) == (1, 4)  # colossalai_cp: all ring
    assert (Layout(cp=4, cp_algo="ulysses_cp").ulysses, Layout(cp=4, cp_algo="ulysses_cp").ring) == (4, 1)
    assert Layout.of(lay.row()) == dataclasses.replace(lay, sequence_parallel=False)
    old = {k: v for k, v in Layout(dp=8).row().items() if k not in Layout.CP_DEFAULTS}  # a row from before cp
    assert Layout.of(old).cp == 1
    with pytest.raises(LabkitError, match="cp_algo = 'ring' is not one of mindformers'"):
        Layout(cp=2, cp_algo="ring").check_context()
    with pytest.raises(LabkitError, match="not divisible by ulysses_degree 3"):
        Layout(cp=4, cp_algo="hybrid_cp", ulysses_degree=3).check_context()


def test_config_keys_are_checked_with_the_key_and_the_fix():
    par = load(ParallelConfig, {"parallel_mode": "semi_auto_parallel", "dp": 2, "cp": 4, "cp_algo": "ulysses_cp"})
    assert RunConfig(parallel=par).layout().devices == 8
    with pytest.raises(LabkitError) as e:
        load(ParallelConfig, {"cp": 2}, "parallel")
    assert "parallel.cp = 2" in e.value.what and "semi_auto_parallel" in e.value.fix
    with pytest.raises(LabkitError) as e:
        load(ParallelConfig, {"parallel_mode": "semi_auto_parallel", "cp": 2, "cp_algo": "ring"}, "parallel")
    assert "parallel.cp_algo" in e.value.what and all(a in e.value.fix for a in CP_ALGOS)
    with pytest.raises(LabkitError, match="parallel.cp must be > 0"):
        load(ParallelConfig, {"cp": 0}, "parallel")


@pytest.mark.parametrize("change, says", [
    (dict(mp=4, cp=16, cp_algo="ulysses_cp"), "num_heads 32 is not divisible by mp 4 x Ulysses degree 16"),
    (dict(cp=2, flash=False), "without flash attention"),
    (dict(cp=2, mode="data_parallel"), "resets context_parallel to 1"),
    (dict(cp=2, seq_split_num=2), "seq_split_num 2"),
    (dict(cp=8, seq=4100), "seq_len 4100 is not divisible by cp 8"),
])
def test_mindformers_rules_refuse_what_it_refuses(change, says):
    seq, flash = change.pop("seq", 4096), change.pop("flash", True)
    mode, split = change.pop("mode", "semi_auto_parallel"), change.pop("seq_split_num", 1)
    with pytest.raises(LabkitError, match=says):
        C.check_mindformers(SEVEN_B, Layout(**change), seq_len=seq, flash_attention=flash, parallel_mode=mode,
                            seq_split_num=split)
    C.check_mindformers(SEVEN_B, Layout(cp=2, cp_algo="ulysses_cp", mp=2), seq_len=4096, flash_attention=True,
                        seq_split_num=2)  # Ulysses has no ring: a sequence pipeline is allowed


def test_activations_are_the_layers_at_s_over_cp_plus_the_attention_terms():
    s, b, h, kv = 32768, 1, SEVEN_B.hidden_size, SEVEN_B.kv_heads * SEVEN_B.head_dim
    base = memory.layer_activations(SEVEN_B, s // 4, b, mp=2, numerics=FA)
    ring = memory.layer_activations(SEVEN_B, s, b, mp=2, numerics=FA, cp=(4, 1))
    uly = memory.layer_activations(SEVEN_B, s, b, mp=2, numerics=FA, cp=(4, 4))
    sc = s / 4 * b
    assert ring["stored"] == base["stored"]  # the ring keeps only its own blocks
    assert ring["working"] == 8 * sc * kv / 2 + sc * h / 2 * 4 / FA.act_bytes  # K, V, dK, dV in flight + dQ fp32
    assert uly["stored"] == base["stored"] + sc * h / 2  # the attention output before the all-to-all back
    assert uly["working"] == sc * (2 * h + 2 * kv) / 2
    full = memory.layer_activations(SEVEN_B, s, b, mp=2, numerics=FA, cp=(4, 4), recompute="full")
    assert full["stored"] == memory.layer_activations(SEVEN_B, s // 4, b, mp=2, numerics=FA, recompute="full")["stored"]
    with pytest.raises(LabkitError, match="without flash attention"):
        memory.layer_activations(SEVEN_B, s, b, cp=(2, 1), numerics=dataclasses.replace(FA, flash_attention=False))


def test_weights_are_replicated_over_cp_and_the_optimizer_shards_over_dp_x_cp():
    kw = dict(seq_len=32768, numerics=FA)
    dp8 = memory.memory_breakdown(SEVEN_B, Layout(dp=8, optimizer_shard=True), **kw)
    cp8 = memory.memory_breakdown(SEVEN_B, Layout(cp=8, optimizer_shard=True), **kw)
    cp8_whole = memory.memory_breakdown(SEVEN_B, Layout(cp=8), **kw)
    assert (cp8["weights"], cp8["optimizer"]) == (dp8["weights"], dp8["optimizer"])
    dp8_whole = memory.memory_breakdown(SEVEN_B, Layout(dp=8), **kw)
    assert cp8_whole["optimizer"] == dp8_whole["optimizer"] > 6 * cp8["optimizer"]
    assert cp8["activations"] < dp8["activations"] / 4


def test_communication_per_layer_follows_the_formulas():
    s, b, bytes_ = 32768, 1, 2
    kv, h = SEVEN_B.kv_heads * SEVEN_B.head_dim, SEVEN_B.hidden_size
    ring = C.comm_bytes(SEVEN_B, Layout(cp=4), s, bytes_)
    kv_all = 2 * s * b * kv * bytes_  # K and V of the whole sequence
    assert ring["ring"] == pytest.approx(3 * 2 * 3 / 4 * kv_all / 2)  # (cp - 1) / cp of it, x 3 (forward, 2 back)
    assert ring["all_to_all"] == 0
    uly = C.comm_bytes(SEVEN_B, Layout(cp=4, cp_algo="ulysses_cp"), s, bytes_, recompute="full")
    assert uly["all_to_all"] == pytest.approx(3 * 3 / 4 * s / 4 * b * (2 * h + 2 * kv) * bytes_)  # 4 tensors x 3
    assert C.comm_bytes(SEVEN_B, Layout(dp=8), s, bytes_) == {"ring": 0.0, "all_to_all": 0.0}


def test_the_planner_searches_cp_where_the_sequence_and_heads_allow():
    assert {s.cp for s in P.plan(SEVEN_B, P.Machine(8, 64), seq_len=32768, global_batch=8)["strategies"]} == {1}
    r = P.plan(SEVEN_B, P.Machine(8, 64), seq_len=32768, global_batch=8, constraints={"cp": "search"})
    seen = {(s.cp, s.layout.cp_algo) for s in r["strategies"]}
    assert {c for c, _ in seen} == {1, 2, 4, 8} and ("hybrid_cp" not in {a for _, a in seen})
    assert all(s.time_s["cp_comm"] > 0 for s in r["strategies"] if s.cp > 1)
    assert all(s.time_s["cp_comm"] == 0 for s in r["strategies"] if s.cp == 1)
    short = P.plan(SEVEN_B, P.Machine(8, 64), seq_len=8, global_batch=8, constraints={"cp": 8})
    assert not short["strategies"] and "sequence not divisible by 2 x cp" in short["skipped"]
    tiny = model_preset("tiny")  # 8 heads, 4 key/value heads: Ulysses over 8 cannot split them
    r = P.plan(tiny, P.Machine(8, 64), seq_len=256, global_batch=8, constraints={"cp": 8, "cp_algo": "ulysses_cp"})
    assert "heads not divisible by mp x Ulysses degree" in r["skipped"]
    r = P.plan(SEVEN_B, P.Machine(8, 64), seq_len=32768, global_batch=8,
               constraints={"cp": 4, "cp_algo": "hybrid_cp", "ulysses_degree": 2})
    assert r["strategies"] and all((s.layout.ulysses, s.layout.ring) == (2, 2) for s in r["strategies"])
    with pytest.raises(LabkitError, match="not divisible by ulysses_degree"):
        P.plan(SEVEN_B, P.Machine(8, 64), constraints={"cp": 4, "cp_algo": "hybrid_cp", "ulysses_degree": 3})


def _run(cp, algo, ulysses=1, **par):
    values = {"data.seq_len": 32768, "parallel.dp": 8 // cp // par.get("mp", 1), "parallel.cp": cp,
              "parallel.cp_algo": algo, "parallel.ulysses_degree": ulysses, "train.global_batch": None,
              **{f"parallel.{k}": v for k, v in par.items()}}
    return load_run_config(MF_7B, values=values)


@pytest.mark.parametrize("cp, algo, ulysses, ring", [(1, "colossalai_cp", 1, False), (4, "colossalai_cp", 1, True),
                                                     (8, "ulysses_cp", 1, False), (4, "hybrid_cp", 2, True)])
def test_the_run_yaml_round_trips_and_mindformers_accepts_it(tmp_path, cp, algo, ulysses, ring):
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig

    cfg = _run(cp, algo, ulysses)
    path = tmp_path / "mf.yaml"
    path.write_text(mf_yaml.run_yaml_text(cfg, cfg.layout(), devices=8), encoding="utf-8")
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    pc, mc = doc["parallel_config"], doc["model"]["model_config"]
    assert pc["context_parallel"] == cp and ("context_parallel_algo" in pc) == (cp > 1)
    assert ("ulysses_degree_in_cp" in pc) == (algo == "hybrid_cp") and mc["use_flash_attention"]
    assert mc.get("use_ring_attention", False) == ring
    back = mf_yaml.read_run_yaml(path)
    assert back["layout"] == cfg.layout() and back["ring_attention"] == ring and back["seq_len"] == 32768
    mine = TransformerOpParallelConfig(**pc)  # mindformers' own class, its _check_context_parallel included
    assert mine.get_ulysses_cp_num() == cfg.layout().ulysses


def test_the_writer_refuses_before_writing():
    cfg = load_run_config(MF_7B, values={"parallel.dp": 1, "parallel.mp": 2, "parallel.cp": 4,
                                         "parallel.cp_algo": "ulysses_cp", "model.num_kv_heads": 4})
    with pytest.raises(LabkitError, match="num_kv_heads 4 is not divisible by mp 2 x Ulysses degree 4"):
        mf_yaml.run_yaml(cfg, cfg.layout(), devices=8)
    cpu = load_run_config(MF_7B, values={"parallel.dp": 4, "parallel.cp": 2, "parallel.device_target": "CPU"})
    with pytest.raises(LabkitError, match="without flash attention"):
        mf_yaml.run_yaml(cpu, cpu.layout(), devices=8)


def test_mindformers_attention_takes_the_written_heads_split():
    """mindformers' LLamaAttention (the class that enforces heads % (mp x Ulysses degree)) builds with what the
    writer accepts and refuses what it refuses (without weights: no_init_parameters)."""
    from labkit.logs import quiet_mindformers

    quiet_mindformers()
    import mindspore as ms
    from mindformers.models.llama.llama_transformer import LLamaAttention
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
    from mindformers.tools.check_rules import _check_context_parallel_algo_valid

    def build(mp, cp, algo):
        pc = TransformerOpParallelConfig(data_parallel=1, model_parallel=mp, context_parallel=cp,
                                         context_parallel_algo=algo)
        with ms.nn.utils.no_init_parameters():
            LLamaAttention(4096, dim=4096, n_heads=32, use_flash_attention=True, parallel_config=pc)
        cfg = types.SimpleNamespace(model=types.SimpleNamespace(model_config=types.SimpleNamespace(
            n_kv_heads=None, num_heads=32)), parallel_config=pc)
        _check_context_parallel_algo_valid(cfg, cp, mp)

    for mp, cp, algo in ((1, 8, "ulysses_cp"), (4, 8, "ulysses_cp"), (8, 8, "colossalai_cp")):
        C.check_mindformers(SEVEN_B, Layout(mp=mp, cp=cp, cp_algo=algo), seq_len=4096, flash_attention=True)
        build(mp, cp, algo)
    with pytest.raises(LabkitError):
        C.check_mindformers(SEVEN_B, Layout(mp=8, cp=8, cp_algo="ulysses_cp"), seq_len=4096, flash_attention=True)
    with pytest.raises(ValueError, match="n_head"):
        build(8, 8, "ulysses_cp")


def test_cli_pins_cp_and_reads_it_from_a_config(tmp_path):
    code, out, err = _cli("--preset", "llama2_7b", "--devices", "8", "--device-memory", "64", "--seq-len", "32768",
                          "--global-batch", "8", "--cp", "4", "--cp-algo", "ulysses_cp", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {(r["cp"], r["cp_algo"]) for r in data["strategies"]} == {(4, "ulysses_cp")}
    assert "context_parallel: 4" in data["mindformers_yaml"] and "use_ring_attention: false" in data["mindformers_yaml"]
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: llama2_7b\ndata:\n  seq_len: 32768\nparallel:\n  cp: 2\n  cp_algo: colossalai_cp\n")
    code, out, err = _cli("--config", str(cfg), "--devices", "8", "--device-memory", "64", "--global-batch", "8",
                          "--json")
    assert code == 0, err
    assert {(r["cp"], r["cp_algo"]) for r in json.loads(out)["strategies"]} == {(2, "colossalai_cp")}


def test_the_7b_at_32k_table_has_its_rows_and_every_yaml_reads_back(tmp_path):
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig

    from labkit.course.pretrain.results import LONG_CONTEXT, long_context_rows

    rows = long_context_rows()
    assert [(r["cards"], r["attention"]) for r in rows] == [(n, a) for n in (8, 16) for a in LONG_CONTEXT.values()]
    for i, r in enumerate(rows):
        assert {"fits", "GiB per card", "layout", "yaml keys", "tokens/s/card", "run_yaml"} <= set(r)
        assert isinstance(r["fits"], bool) and r["GiB per card"] > 0
        doc = r["run_yaml"]
        pc = doc["parallel_config"]
        assert r["yaml keys"]["context_parallel"] == pc["context_parallel"]
        assert (pc["context_parallel"] > 1) == (r["attention"] != LONG_CONTEXT["none"])
        path = tmp_path / f"row{i}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        back = mf_yaml.read_run_yaml(path)
        lay = back["layout"]
        assert lay.devices == r["cards"] and back["seq_len"] == 32768
        assert pc["data_parallel"] * pc["model_parallel"] * pc["pipeline_stage"] * pc["context_parallel"] == r["cards"]
        C.check_mindformers(back["model"], lay, seq_len=back["seq_len"], flash_attention=back["flash_attention"])
        assert TransformerOpParallelConfig(**pc).get_ulysses_cp_num() == lay.ulysses
        assert back["ring_attention"] == (lay.ring > 1)


@pytest.mark.parametrize("compressed", [False, True])
def test_the_mask_bytes_are_what_mindformers_mask_cell_allocates(ms, compressed):
    """mindformers' own mask cell (LowerTriangularMaskWithDynamic, with the arguments LlamaModel.__init__ gives it)
    at 2048 tokens, the shortest compression accepts: its constant and the mask its construct returns have the bytes
    mask_bytes counts, in the compute dtype and uint8. At 32k the count is the same shape rule scaled: s² for
    the full mask, nothing for the compressed one; and the 7B-at-32k table shows both."""
    import numpy as np
    from mindformers.modules.transformer.transformer import LowerTriangularMaskWithDynamic

    from labkit.course.pretrain.results import long_context_rows

    s, b, f16 = 2048, 2, 2
    cell = LowerTriangularMaskWithDynamic(seq_length=s, batch_size=b, compute_type=ms.float16, pad_token_id=0,
                                          use_flash_attention=True, use_attn_mask_compression=compressed)
    tokens = np.ones((b, s), np.int32)
    tokens[1, -7:] = 0  # padding at the end of a row
    out = cell(ms.Tensor(tokens))
    want = C.mask_bytes(s, b, f16, ring=False, compressed=compressed)
    assert cell.lower_triangle_mask.nbytes == want["constant"]
    if compressed:
        assert out.shape == (2048, 2048) and out.dtype == ms.uint8 and want["stored"] == 0
        # sparse_mode 2 reads the causal pattern alone: a query never sees a later key
        assert np.array_equal(out.asnumpy(), np.triu(np.ones((s, s), np.uint8), 1))
    else:
        assert out.shape == (b, 1, s, s) and out.dtype == ms.uint8 and out.nbytes == want["stored"]
        full = out.asnumpy()[:, 0]  # 1 = masked: the future, and the padded keys
        assert np.array_equal(full[0], np.triu(np.ones((s, s), np.uint8), 1))
        assert full[1, :, -7:].all() and np.array_equal(full[1, :-7, :-7], full[0, :-7, :-7])
    grow = 1 if compressed else (32768 / s) ** 2
    at_32k = C.mask_bytes(32768, 1, f16, ring=False, compressed=compressed)
    assert at_32k["constant"] == want["constant"] * grow and at_32k["stored"] == want["stored"] / b * grow
    assert C.mask_bytes(32768, 1, f16, ring=True, compressed=compressed) == {"constant": 0, "stored": 0, "working": 0}
    column = "mask GiB, compressed" if compressed else "mask GiB, full"
    for r in long_context_rows():  # fp16, micro-batch 1 in every row
        mc = r["run_yaml"]["model"]["model_config"]
        assert mc["use_attn_mask_compression"] and r["batch"].startswith("1 x")
        cell_scaled = (want["constant"] * grow + want["stored"] / b * grow) / 2**30
        assert r[column] == (0 if mc.get("use_ring_attention") else round(cell_scaled, 3))


def test_the_writer_compresses_the_mask_from_2048_tokens_with_flash_attention():
    long, short = _run(1, "colossalai_cp"), load_run_config(MF_7B, values={"data.seq_len": 1024})
    assert mf_yaml.run_yaml(long, long.layout(), devices=8)["model"]["model_config"]["use_attn_mask_compression"]
    assert "use_attn_mask_compression" not in mf_yaml.run_yaml(short, short.layout(), devices=8)["model"]["model_config"]
    assert not C.mask_compression(32768, flash_attention=False)
