"""Every shipped run config loads, notebook 07's parameters agree with the config glossary, and the planner
verdicts written into the 7B configs' comments are the planner's."""
import typing

import pytest

from labkit.course import pretrain
from labkit.config import AMP_LEVELS, RunConfig, TrainConfig, coerce, load_run_config, read_yaml
from labkit.errors import LabkitError
from labkit.paths import CONFIGS, NOTEBOOKS

NOT_RUN_CONFIGS = {"compat.yaml"}  # the doctor's compatibility table
RUN_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name not in NOT_RUN_CONFIGS)


def test_there_are_run_configs():
    names = {p.name for p in RUN_CONFIGS}
    assert {"tiny_cpu.yaml", "llama2_7b_mindformers.yaml", "llama2_7b_seed.yaml"} <= names


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_run_config_loads(path):
    cfg = load_run_config(path)
    model = cfg.model_config()
    t, p = cfg.train, cfg.parallel
    assert cfg.data.seq_len <= model.max_position_embeddings
    if t.global_batch is not None:  # the stated global batch is micro_batch x dp x accum
        dp = p.dp or 1
        assert t.micro_batch * dp * t.accum == t.global_batch or p.dp is None
    assert read_yaml(path).get("output_dir", "").startswith("runs/")  # artifacts only under runs/


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_run_config_is_fully_spelled_out(path):
    """Unknown keys fail (load refuses them); here also: every section is a known one."""
    data = read_yaml(path)
    assert set(data) <= {f.name for f in RunConfig.__dataclass_fields__.values()}


def test_parameters_are_the_config_fields_own_names():
    """One glossary, one spelling: a parameter that sets a config field has that field's name, and its type comes
    from the field's type hint (what the field is written as: a Recompute as its text, a Literal as its values)."""
    for p in pretrain.PARAMETERS:
        if p.field is None:
            assert p.given in (int, float, str, bool), p
            continue
        assert p.field.split(".")[-1] == p.name and p.given is None, p
    assert pretrain.PARAMS["recompute"].type_name == "Optional[str]"
    assert pretrain.PARAMS["amp_level"].type == str | None and pretrain.PARAMS["lr"].type == float | None
    assert pretrain.PARAMS["node_rank"].type_name == "int"
    names = [p.name for p in pretrain.PARAMETERS]
    assert len(names) == len(set(names))


def test_notebook_parameters_agree_with_the_glossary():
    import papermill

    declared = papermill.inspect_notebook(str(NOTEBOOKS / "07_pretrain.ipynb"))
    assert list(declared) == [p.name for p in pretrain.PARAMETERS]
    for p in pretrain.PARAMETERS:
        d = declared[p.name]
        assert d["inferred_type_name"] == p.type_name, p.name
        assert d["default"] == repr(p.default), p.name
        assert d["help"] == p.help, p.name  # papermill --help-notebook shows it
    issue_names = ("preset device_target devices nodes device_memory_gib dp mp pp micro_batch accum seq_len recompute "
                   "amp_level lr warmup_steps min_lr steps save_every dataset tokenizer init_checkpoint output_dir")
    assert set(issue_names.split()) <= set(declared)  # the stable names cluster scripts pass


def test_presets_point_at_shipped_configs():
    for name, preset in pretrain.PRESETS.items():
        assert (CONFIGS.parent / preset["config"]).is_file(), name


# ------------------------------------------------------------------------------- the 7B recipes' verdicts


def test_mindformers_recipe_fits_as_its_comments_say():
    text = " ".join((CONFIGS / "llama2_7b_mindformers.yaml").read_text().replace("#", " ").split())
    mf, bf16, o2, o2_level2 = pretrain.compare_recipes()[:4]
    assert mf["fits"] and bf16["fits"] and o2_level2["fits"] and not o2["fits"]
    assert f"= {mf['total GiB']:.1f} GiB" in text and f"needs {o2['total GiB']:.1f} GiB" in text
    assert f"({o2_level2['total GiB']:.1f} GiB)" in text and bf16["total GiB"] == mf["total GiB"]
    assert f"{mf['tokens/s/device']:,} tokens/s per device" in text
    cfg = load_run_config("configs/llama2_7b_mindformers.yaml")
    assert cfg.train.steps == round(100e9 / (64 * 4096)) and cfg.train.warmup_steps == int(0.03 * cfg.train.steps)


def test_seed_recipe_verdicts_match_its_comments():
    text = (CONFIGS / "llama2_7b_seed.yaml").read_text()
    rows = pretrain.compare_recipes()
    written, shard_only, shard_all, shipped, written_a100, shipped_a100 = rows[4:]
    assert not written["fits"] and not written_a100["fits"] and not shard_only["fits"]
    assert shard_all["fits"] and shipped["fits"] and shipped_a100["fits"]
    assert f"model states {written['model states GiB']} GiB alone" in text
    for r in (written, written_a100):
        assert f"{r['total GiB']} GiB" in text
    assert f"= {shard_only['total GiB']} GiB" in text
    assert f"{shard_all['total GiB']} GiB fits, {shard_all['tokens/s/device']:,} tokens/s" in text
    assert f"{shipped['total GiB']} GiB fits ({shipped_a100['total GiB']} on A100 80 GB), " \
           f"{shipped['tokens/s/device']:,} tokens/s" in text
    cfg = load_run_config("configs/llama2_7b_seed.yaml")
    t = cfg.train
    # what the seed says and the change stays what the comments say
    assert (t.global_batch, t.lr, t.min_lr, t.warmup_steps, t.weight_decay, t.scale_window) == \
        (512, 3e-4, 3e-5, 2000, 0.1, 4000)
    assert (t.beta1, t.beta2, t.amp_level, str(t.recompute)) == (0.9, 0.95, "O2", "last:16")
    assert (cfg.data.num_parallel_workers, cfg.data.prefetch, cfg.parallel.dp) == (16, 64, 8)
    assert t.micro_batch * cfg.parallel.dp * t.accum == 512 and cfg.parallel.optimizer_shard
    assert cfg.parallel.optimizer_level == "level2"


@pytest.mark.parametrize("tp, value, want", [
    (int, "3", 3), (int, 2.0, 2), (float, "1e3", 1000.0), (bool, "Yes", True), (bool, "off", False),
    (str, 5, "5"), (int | None, None, None), (typing.Optional[float], "0.5", 0.5), (float | str, "x", "x"),
    (list[int], ("1", 2.0), [1, 2]), (typing.Literal["O0", "O2"], "O2", "O2"), (dict, {"a": 1}, {"a": 1}),
    (typing.Any, object, object),
])
def test_coerce_converts_gently(tp, value, want):
    assert coerce(value, tp, "x") == want


@pytest.mark.parametrize("tp, value, says", [
    (int, 1.5, "x must be an integer"), (int, True, "x must be an integer"), (int, "inf", "x must be an integer"),
    (float, False, "x must be a number"), (bool, "maybe", "x must be true or false"), (str, [1], "x must be a string"),
    (list[int], 3, "x must be a list"), (list[int], [1, "a"], "x[1] must be an integer"),
    (typing.Literal["O0"], "O9", "x = 'O9' is not allowed"), (dict, [], "x must be a mapping"),
    (int | None, "a", "x must be an integer"), (set, {1}, "x: unsupported type set"),
])
def test_coerce_names_the_field_when_it_refuses(tp, value, says):
    with pytest.raises(LabkitError) as e:
        coerce(value, tp, "x")
    assert says in e.value.what


def test_amp_levels_are_one_table():
    """labkit.config.AMP_LEVELS lists every level TrainConfig.amp_level accepts, the notebook's widget offers, and
    the state census counted (the planner refuses a level without a census)."""
    from labkit.course.widgets import CHOICES
    from labkit.parallel import census

    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["amp_level"])) == set(AMP_LEVELS)
    assert CHOICES["amp_level"][1:] == list(AMP_LEVELS)
    assert {c["amp_level"] for c in census.load_states()["cases"].values()} == set(AMP_LEVELS)
