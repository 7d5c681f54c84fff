"""Notebook 07's logic (labkit.course.pretrain, labkit.course.widgets) and the notebook itself under papermill: the 7B plan-only
path and the validation stop here; its multi-worker training path runs once per node in tests/test_multinode.py
(two nodes, resumed, equal to one node and one card), its CPU smoke run under nbval."""
import html
import json
import shlex

import pytest
import yaml

from labkit.course import pretrain
from labkit.config import load_run_config, model_preset
from labkit.layout import Recompute
from labkit.errors import LabkitError
from labkit.model.shapes import num_params
from labkit.paths import NOTEBOOKS

NB07 = NOTEBOOKS / "07_pretrain.ipynb"


def error_of(**params) -> LabkitError:
    with pytest.raises(LabkitError) as e:
        pretrain.resolve(params)
    return e.value


# ------------------------------------------------------------------------------------------ validation


def test_7b_preset_is_a_plan_for_8_cards_of_64_gib():
    run = pretrain.resolve({"preset": "llama2_7b"})
    p, t = run.cfg.parallel, run.cfg.train
    assert (run.devices, run.device_memory_gib, p.device_target) == (8, 64.0, "Ascend")
    assert (p.dp, p.mp, p.pp, t.micro_batch, t.accum, t.global_batch) == (8, 1, 1, 1, 8, 64)  # mindformers' recipe
    assert p.parallel_mode == "semi_auto_parallel" and p.optimizer_shard
    assert run.strategy.fits and 60 < run.strategy.memory_gib["total"] <= 64
    assert not run.can_train and "Ascend" in run.why_not  # this machine has no NPU: plan only, no error
    assert num_params(run.model) == 6_738_415_616


def test_pinned_layout_must_multiply_to_devices():
    e = error_of(devices=2, dp=3)
    assert "dp x mp x pp must equal devices (2)" in e.what and "dp 3 does not divide 2" in e.what
    assert "leave dp/mp/pp None" in e.fix
    e = error_of(preset="llama2_7b", dp=2, mp=2, pp=1)
    assert "= 4 != 8" in e.what


def test_batch_arithmetic_names_the_numbers():
    e = error_of(preset="llama2_7b", dp=8, micro_batch=3)
    assert "micro_batch 3 does not divide global_batch / dp = 64 / 8 = 8" in e.what
    e = error_of(preset="llama2_7b", dp=8, micro_batch=1, accum=4, global_batch=64)
    assert "micro_batch 1 x dp 8 x accum 4 = 32, not global_batch 64" in e.what


def test_accum_and_micro_batch_follow_the_global_batch():
    run = pretrain.resolve({"preset": "llama2_7b", "devices": 4, "device_memory_gib": 80})
    t = run.cfg.train
    assert t.micro_batch * run.cfg.parallel.dp * t.accum == 64
    run = pretrain.resolve({"preset": "llama2_7b_seed", "global_batch": 256})
    assert run.cfg.train.accum == 32 and run.sources["accum"][1].startswith("global_batch")


def test_memory_that_does_not_fit_stops_with_the_planners_alternative():
    # the seeds' recipe as written on 8 x 64 GiB: plain data parallel, micro-batch 4, 16 layers recomputed
    e = error_of(preset="llama2_7b_seed", dp=8, micro_batch=4, optimizer_shard=False)
    assert "no layout fits in 64 GiB" in e.what and "model states 100.4" in e.what
    assert "-p optimizer_shard True" in e.fix and "-p dp 8" in e.fix


def test_cpu_refuses_what_mindspore_refuses():
    assert "refused on CPU" in error_of(preset="llama2_7b", device_target="CPU").what  # optimizer_shard
    assert "semi_auto_parallel" in error_of(devices=2, mp=2).what


def test_parameter_types_and_names_are_checked():
    assert "steps must be an integer" in error_of(steps="many").what
    e = error_of(preset="llama2_70b")
    assert "preset" in e.what and "llama2_7b" in e.fix
    assert "seq_len = 4096 exceeds" in error_of(seq_len=4096).what
    e = error_of(preset="llama2_7b", recompute="last:x")
    assert "recompute" in e.what


def test_other_nodes_need_the_master_when_training():
    e = error_of(devices=2, nodes=2)
    assert "master_addr and master_port" in e.what
    run = pretrain.resolve({"preset": "llama2_7b", "devices": 16})  # plan only: placeholders in the commands
    assert run.nodes == 2 and run.workers == 8
    cmds = pretrain.commands(run)["labkit_launch"]
    assert len(cmds) == 2 and "--node-rank 1" in cmds[1] and "NODE0_HOST" in cmds[0]


def test_only_node_0_writes_the_run_files(tmp_path, capsys):
    """Several nodes share output_dir: node 0 writes run.yaml & co. once; another node writes none and says why."""
    params = {"preset": "llama2_7b", "devices": 16, "output_dir": str(tmp_path)}  # 2 nodes, plan only here
    node1 = pretrain.resolve({**params, "node_rank": 1})
    assert pretrain.write_configs(node1) == {} and not list(tmp_path.iterdir())
    assert not pretrain.node0_only(node1, "configs")
    assert "node 1 of 2 skips this cell: run.yaml, mindformers.yaml" in capsys.readouterr().out
    node0 = pretrain.resolve(params)
    assert pretrain.node0_only(node0, "configs") and capsys.readouterr().out == ""
    assert set(pretrain.write_configs(node0)) == {p.name for p in tmp_path.iterdir()} == {
        "run.yaml", "mindformers.yaml", "plan.json", "launch.sh"}
    head = (tmp_path / "run.yaml").read_text()
    assert all(line in head for line in pretrain.commands(node0)["labkit_launch"])  # every node's command


@pytest.mark.slow
def test_cpu_runs_resolve_with_measured_peak_and_check_the_output_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = pretrain.resolve({"devices": 2, "output_dir": "out"})
    assert run.can_train and run.cfg.parallel.parallel_mode == "data_parallel"
    assert (run.cfg.train.micro_batch, run.cfg.train.accum, run.cfg.train.global_batch) == (4, 1, 8)
    assert run.output_dir == tmp_path / "out"  # relative to where the user runs
    assert run.device_memory_gib < pretrain.host_ram_gib()  # the host's RAM is shared by the workers
    e = error_of(output_dir="out", resume=True)
    assert "no complete checkpoint" in e.what
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    e = error_of(output_dir="out")
    assert "already holds a run" in e.what and "-p resume True" in e.fix
    assert pretrain.resolve({"output_dir": "out", "overwrite": True}).overwrite
    monkeypatch.setenv("LABKIT_CALLER_CWD", str(tmp_path / "elsewhere"))  # `labkit run` says where it was called
    assert pretrain.resolve({"output_dir": "x"}).output_dir == tmp_path / "elsewhere" / "x"
    assert "not found" in error_of(dataset="no/such/dir").what


def test_resuming_on_other_cards_sets_the_keys_mindformers_reads(tmp_path):
    """-p resume_from / resume_strategy become mindformers' load_checkpoint, resume_training, auto_trans_ckpt and
    src_strategy_path_or_dir; each key is one mindformers 1.9's own loading code reads (its source, not a list kept
    here), and a strategy without shards to continue from is refused by name."""
    import inspect

    from mindformers.trainer import trainer, utils

    src = tmp_path / "old" / "output"
    params = {"preset": "llama2_7b", "devices": 16, "output_dir": str(tmp_path / "run")}
    run = pretrain.resolve({**params, "resume_from": str(src / "checkpoint"),
                            "resume_strategy": str(src / "strategy")})
    mf = yaml.safe_load(pretrain.write_configs(run)["mindformers.yaml"].read_text())
    keys = {"load_checkpoint": str(src / "checkpoint"), "resume_training": True, "auto_trans_ckpt": True,
            "src_strategy_path_or_dir": str(src / "strategy")}
    assert {k: mf[k] for k in keys} == keys
    reader = inspect.getsource(utils) + inspect.getsource(trainer)
    assert all(f"config.{k}" in reader for k in keys)
    same_layout = yaml.safe_load(pretrain.mindformers_yaml(pretrain.resolve({**params, "resume_from": str(src)})))
    assert (same_layout["auto_trans_ckpt"], same_layout["src_strategy_path_or_dir"]) == (False, "")
    own = yaml.safe_load(pretrain.mindformers_yaml(pretrain.resolve({**params, "resume": True})))
    assert own["load_checkpoint"] == "./output/checkpoint" and own["resume_training"] is True
    fresh = yaml.safe_load(pretrain.mindformers_yaml(pretrain.resolve(params)))
    assert (fresh["load_checkpoint"], fresh["resume_training"], fresh["auto_trans_ckpt"]) == ("", False, False)
    e = error_of(**params, resume_strategy=str(src / "strategy"))
    assert "resume_strategy" in e.what and "resume_from" in e.fix


def test_a_resume_folder_without_shards_is_refused_where_the_run_trains(tmp_path):
    (tmp_path / "ck" / "rank_0").mkdir(parents=True)
    e = error_of(output_dir=str(tmp_path / "run"), resume_from=str(tmp_path / "ck"))
    assert "resume_from" in e.what and "rank_0" in e.what and "rank_N" in e.fix
    e = error_of(output_dir=str(tmp_path / "run"), resume_from=str(tmp_path / "none"))
    assert "not found" in e.what


# ------------------------------------------------------------------------------------------ estimates


def test_partial_recompute_lies_between_none_and_all():
    rows = {rc: pretrain.recipe_row(rc, "configs/llama2_7b_seed.yaml", {"train.recompute": rc})
            for rc in ("none", "last:16", "all")}
    acts = [rows[k]["activations GiB"] for k in ("none", "last:16", "all")]
    assert acts[0] > acts[1] > acts[2]
    assert abs(acts[1] - (acts[0] + acts[2]) / 2) < 0.2  # half the layers recomputed
    assert rows["none"]["step s"] < rows["last:16"]["step s"] < rows["all"]["step s"]


def test_stage_recompute_counts_for_mindformers():
    assert Recompute.parse("last:16").stage_counts(32, 1) == [16]
    assert Recompute.parse("last:16").stage_counts(32, 2) == [0, 16]
    assert Recompute.parse("all").stage_counts(32, 4) == [8, 8, 8, 8]


def test_expected_shapes_use_mindformers_names():
    shapes = pretrain.expected_shapes(model_preset("llama2_7b"))
    assert shapes["model.layers.0.feed_forward.w2.weight"] == (4096, 11008)
    assert shapes["model.tok_embeddings.embedding_weight"] == (32000, 4096)


# ------------------------------------------------------------------------------------------ files


def test_written_configs_agree(tmp_path):
    run = pretrain.resolve({"preset": "llama2_7b_seed", "output_dir": str(tmp_path / "seed")})
    files = pretrain.write_configs(run)
    assert set(files) == {"run.yaml", "mindformers.yaml", "plan.json", "launch.sh"}
    assert load_run_config(files["run.yaml"]) == run.cfg
    mf = yaml.safe_load(files["mindformers.yaml"].read_text())
    assert mf["parallel_config"]["data_parallel"] == 8 and mf["parallel"]["enable_parallel_optimizer"] is True
    assert mf["parallel"]["parallel_mode"] == 1  # semi-auto
    assert mf["runner_config"]["batch_size"] == 1 and mf["runner_config"]["gradient_accumulation_steps"] == 64
    assert mf["recompute_config"]["recompute"] == [16]
    assert mf["optimizer"] == {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert mf["lr_schedule"]["learning_rate"] == 3e-4 and mf["lr_schedule"]["lr_end"] == 3e-5
    assert mf["lr_schedule"]["warmup_steps"] == 2000
    assert mf["train_dataset_task"]["dataset_config"] == mf["train_dataset"]
    assert mf["train_dataset"]["num_parallel_workers"] == 16 and mf["train_dataset"]["prefetch_size"] == 64
    mc = mf["model"]["model_config"]
    assert (mc["seq_length"], mc["compute_dtype"], mc["use_flash_attention"]) == (4096, "float16", True)
    assert mf["context"]["max_device_memory"] == "58GB"  # 64 GiB less the preset's 6 GiB, as mindformers does
    plan = json.loads(files["plan.json"].read_text())
    assert plan["strategy"]["fits"] and plan["can_train_here"] is False
    launch = files["launch.sh"].read_text()
    assert "labkit launch --workers 8" in launch and "msrun_launcher.sh" in launch and "-p preset llama2_7b_seed" \
        in launch
    merge = pretrain.commands(run)["merge"]  # after the run: a command `labkit ckpt merge` parses as written
    assert f"# {merge}" in launch
    from labkit.cli import build_parser

    args = build_parser().parse_args(shlex.split(merge)[1:])
    assert (args.tool, args.model, args.hf) == ("mindspore", str(files["run.yaml"]), str(tmp_path / "seed" / "hf"))


# ------------------------------------------------------------------------------------------ display pieces


def test_figure_and_status_line():
    rows = [{"step": i, "loss": 8 - i / 10, "tokens_per_s": 3000.0, "mfu": 0.5, "peak_mem_mb": 2000.0, "lr": 1e-3}
            for i in range(1, 6)]
    assert pretrain.figure_png(rows)[:8] == b"\x89PNG\r\n\x1a\n"
    assert pretrain.figure_png([])[:4] == b"\x89PNG"
    assert "step 5/10" in pretrain.status_line(rows, 10) and "waiting" in pretrain.status_line([], 10)


class FakeDisplay:
    """IPython's display(obj, display_id=True) as a log of what was shown and updated, per handle."""

    def __init__(self):
        self.log = []

    def __call__(self, obj, display_id=True):
        display, n = self, len(self.log)

        class Handle:
            def update(self, new):
                display.log.append((n, "update", new))

        self.log.append((n, "display", obj))
        return Handle()

    def texts(self) -> list[str]:
        return [repr(o) for _, _, o in self.log if type(o).__name__ == "Text"]

    def images(self) -> list[bytes]:
        return [o.data for _, _, o in self.log if type(o).__name__ == "Image"]


ROWS = [{"step": i, "loss": 8 - i / 10, "tokens_per_s": 3000.0, "mfu": 0.5, "peak_mem_mb": 2000.0, "lr": 1e-3,
         "grad_norm": 1.0} for i in range(1, 6)]


@pytest.mark.slow
def test_live_plot_and_follower_share_one_view(monkeypatch, tmp_path):
    """LivePlot (an on_step callback) and Follower (metrics.jsonl of another process) both redraw a LiveView."""
    from labkit.course import plots

    shown = FakeDisplay()
    monkeypatch.setattr(plots, "display_function", lambda: shown)
    live = plots.LivePlot(every=2, label="run")
    for r in ROWS:
        live(r)
    live.close()
    assert [kind for _, kind, _ in shown.log] == ["display", "update", "update", "update"]  # steps 2, 4, close
    assert all(png[:4] == b"\x89PNG" for png in shown.images())

    shown = FakeDisplay()
    monkeypatch.setattr(plots, "display_function", lambda: shown)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]) + '{"step": 4, "lo', encoding="utf-8")
    f = pretrain.Follower(metrics, steps=10)
    assert isinstance(f.view, plots.LiveView) and "waiting for step 1 of 10" in shown.texts()[0]
    f.poll()
    f.poll()  # nothing new: no redraw
    assert shown.texts()[-1].startswith("step 3/10") and len(shown.images()) == 2


@pytest.mark.slow
def test_follower_reports_a_failure_once_and_keeps_following(monkeypatch, tmp_path, capsys):
    from labkit.course import plots

    shown = FakeDisplay()
    monkeypatch.setattr(plots, "display_function", lambda: shown)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 7.0}) + "\n", encoding="utf-8")  # no tokens_per_s
    f = pretrain.Follower(metrics, steps=10)
    f.poll()
    metrics.write_text(metrics.read_text() + json.dumps({"step": 2, "loss": 6.9}) + "\n", encoding="utf-8")
    f.poll()
    warnings = [t for t in shown.texts() if t.startswith("warning:")]
    assert len(warnings) == 1 and "KeyError" in warnings[0] and str(metrics) in warnings[0]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    f.poll()
    assert shown.texts()[-1].startswith("step 5/10")

    monkeypatch.setattr(plots, "display_function", lambda: None)  # no kernel: the warning goes to stderr
    f = pretrain.Follower(tmp_path / "missing" / "metrics.jsonl", steps=3)
    f.view.warn("first")
    f.view.warn("second")
    assert f.view.warning == "first" and capsys.readouterr().err == "warning: first\n"


def test_widget_form_edits_a_copy_and_applies_on_click(monkeypatch):
    from labkit.course import widgets

    monkeypatch.delenv("CI", raising=False)
    ns = {"preset": "llama2_7b", "dp": None}
    form = widgets.ParameterForm(ns)
    need = pretrain.resolve(dict(ns), check_files=False).strategy.memory_gib["total"]
    assert "fits" in form.verdict.value and f"{need:.1f} of 64 GiB" in form.verdict.value
    # what the browser shows (tests/test_ui.py): None selected, not an empty box; the glossary on each label
    assert form.inputs["device_target"].index == 0 and form.inputs["device_target"].value is None
    assert f'title="{html.escape(pretrain.PARAMS["dp"].help)}">dp<' in form.inputs["dp"].description
    form.inputs["dp"].value = "3"  # invalid: shown at once, nothing applied
    assert "dp x mp x pp must equal devices" in form.verdict.value
    assert form.apply() is None and ns["dp"] is None and "run" not in ns
    form.inputs["dp"].value = "None"
    form.inputs["optimizer_shard"].value = False
    assert "fits" in form.verdict.value
    run = form.apply()
    assert ns["optimizer_shard"] is False and ns["run"] is run and not run.cfg.parallel.optimizer_shard
    assert "applied" in form.status.value


def test_widget_form_is_off_unless_asked_and_headless(monkeypatch, capsys):
    from labkit.course import widgets

    assert widgets.parameter_form({}, enabled=False) is None
    monkeypatch.setenv("LABKIT_HEADLESS", "1")
    assert widgets.parameter_form({}, enabled=True) is None
    assert "widget form off" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ the notebook


def execute(tmp_path, **params):
    import papermill

    out = tmp_path / "07_pretrain.ipynb"
    papermill.execute_notebook(str(NB07), str(out), parameters=params, kernel_name="python3", cwd=str(NOTEBOOKS),
                               progress_bar=False, log_output=False)
    return json.loads(out.read_text(encoding="utf-8"))


def outputs(nb) -> str:
    text = []
    for c in nb["cells"]:
        for o in c.get("outputs", []):
            text.append("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


@pytest.mark.slow
def test_notebook_plans_7b_without_devices(tmp_path):
    nb = execute(tmp_path, preset="llama2_7b", output_dir=str(tmp_path / "7b"))
    text = outputs(nb)
    assert "NOT TRAINED on this machine" in text and "plan only" in text
    assert "✓ Llama-2-7B has 6,738,415,616 parameters" in text
    assert "✓ all 291 tensors have the shapes the config implies" in text
    files = {p.name for p in (tmp_path / "7b").iterdir()}
    assert {"run.yaml", "mindformers.yaml", "plan.json", "launch.sh"} <= files and "metrics.jsonl" not in files


@pytest.mark.slow
def test_notebook_stops_in_the_validation_cell(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as e:
        execute(tmp_path, devices=2, dp=3)
    assert e.value.ename == "LabkitError" and "dp x mp x pp must equal devices (2)" in e.value.evalue
    nb = json.loads((tmp_path / "07_pretrain.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    failed = [i for i, c in enumerate(code) if any(o["output_type"] == "error" for o in c["outputs"])]
    assert len(failed) == 1
    assert "pretrain.resolve(globals())" in "".join(code[failed[0]]["source"])  # the first cell after parameters
    assert "injected-parameters" in code[failed[0] - 1]["metadata"]["tags"]
    assert all(c["execution_count"] is None for c in code[failed[0] + 1:])  # nothing after it ran


@pytest.mark.parametrize("params", [{"preset": "llama2_7b"}, {"preset": "llama2_7b_seed"},
                                    {"preset": "llama2_7b", "amp_level": "O2", "optimizer_level": "level3"},
                                    {"preset": "llama2_7b", "amp_level": "bf16", "recompute": "all"}])
def test_the_yaml_read_back_gives_the_plans_figure(tmp_path, params):
    """One plan, one number: the mindformers YAML notebook 07 writes, read back by the keys mindformers reads,
    gives the planner the same memory per card, and the plan fits under the max_device_memory it sets."""
    from labkit.parallel.memory import Numerics, memory_breakdown
    from labkit.parallel.mindformers_yaml import read_run_yaml
    from labkit.parallel.planner import FIT_MARGIN_GIB

    run = pretrain.resolve({**params, "output_dir": str(tmp_path / "run")})
    path = pretrain.write_configs(run)["mindformers.yaml"]
    back = read_run_yaml(path)
    assert back["amp_level"] == run.cfg.train.amp_level and back["layout"] == run.strategy.layout
    mem = memory_breakdown(back["model"], back["layout"], seq_len=back["seq_len"],
                           numerics=Numerics(back["amp_level"], flash_attention=back["flash_attention"]),
                           overhead_gib=run.device.overhead_gib)
    assert mem["total"] == pytest.approx(run.strategy.memory_gib["total"], abs=0.001)
    assert mem["total"] - mem["overhead"] + FIT_MARGIN_GIB <= back["max_device_memory_gib"]
