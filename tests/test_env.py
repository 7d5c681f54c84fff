"""`labkit doctor`: the pure judgement functions on made-up machines, the tables against the installed packages,
and the command itself (JSON contract, exit status, readable fixes)."""
import json
import subprocess
import sys

import pytest

from labkit.doctor import env
from labkit.doctor import registries
from labkit.paths import ROOT

COMPAT = env.load_compat()
VMAP = env.version_map()


def facts(**over):
    """A healthy CPU machine; `over` replaces parts of it."""
    base = {
        "versions": {"python": "3.11.7", "mindspore": "2.9.0", "mindformers": "1.9.0", "torch": "2.13.0",
                     "transformers": "4.57.1", "numpy": "1.26.4"},
        "requires_python": ">=3.11,<3.12", "dependencies": [],
        "plugins": {"cpu": True, "gpu_cuda": ["11.1", "11.6"], "ascend": True},
        "hardware": {"nvidia_gpus": [], "cuda_runtimes": [], "npus": [], "cann": None, "ascend_driver": None},
        "devices": {"CPU": {"works": True, "error": ""}, "GPU": {"works": False, "error": "no plugin"},
                    "Ascend": {"works": False, "error": "no CANN"}},
    }
    for key, value in over.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return base


def test_a_healthy_cpu_machine_has_nothing_to_report():
    assert env.assess(facts(), COMPAT, VMAP) == ([], [], True)


def test_a_visible_gpu_that_mindspore_cannot_use_gives_a_loud_warning():
    problems, warnings, ok = env.assess(facts(hardware={"nvidia_gpus": ["A100"], "cuda_runtimes": ["12.4"]}),
                                        COMPAT, VMAP)
    assert ok and not problems and len(warnings) == 1
    w = warnings[0]
    assert w["what"].startswith("!!!") and "tens of times slower" in w["what"] and "12.4" in w["what"]
    assert "11.1 or 11.6" in w["fix"] and "LD_LIBRARY_PATH" in w["fix"]


def test_a_visible_npu_that_mindspore_cannot_use_gives_a_loud_warning_naming_cann():
    _, warnings, _ = env.assess(facts(hardware={"npus": ["davinci0"], "cann": "8.1.RC1"}), COMPAT, VMAP)
    text = " ".join(w["what"] + w["fix"] for w in warnings)
    assert "!!!" in text and "CANN 9.0.0" in text and "8.1.RC1" in text


def test_mindformers_and_mindspore_that_do_not_match_are_incompatible():
    problems, _, ok = env.assess(facts(versions={"mindspore": "2.7.2"}), COMPAT, VMAP)
    assert not ok and any("VERSION_MAP.json" in p["what"] and "mindspore==2.9.0" in p["fix"] for p in problems)


def test_a_python_outside_the_lab_and_the_wheels_is_caught():
    problems, _, ok = env.assess(facts(versions={"python": "3.13.1"}), COMPAT, VMAP)
    whats = " ".join(p["what"] for p in problems)
    assert not ok and "requires-python" in whats and "no wheel for Python 3.13" in whats


def test_missing_packages_and_a_cpu_that_fails_are_problems():
    problems, _, ok = env.assess(facts(versions={"torch": None},
                                       devices={"CPU": {"works": False, "error": "boom"}}), COMPAT, VMAP)
    assert not ok and len(problems) == 2 and all(p["fix"] for p in problems)


def test_pin_drift_is_a_warning_not_an_incompatibility():
    installed_numpy = env.installed_versions()["numpy"]
    _, warnings, ok = env.assess(facts(dependencies=["numpy==0.1"]), COMPAT, VMAP)
    assert ok and any(f"numpy {installed_numpy} does not match" in w["what"] for w in warnings)


def test_compat_table_matches_the_installed_wheel():
    """configs/compat.yaml's CUDA list is what the installed MindSpore wheel really carries, and the lab's
    Python is one the wheel is published for."""
    v = env.installed_versions()
    row = COMPAT["mindspore"][v["mindspore"]]
    assert env.wheel_plugins()["gpu_cuda"] == row["cuda"]
    assert ".".join(v["python"].split(".")[:2]) in row["python"]
    assert VMAP["mf"][v["mindformers"]]["support"] == [v["mindspore"]]


def test_model_dir_errors_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{oops")
    (tmp_path / "notype").mkdir()
    (tmp_path / "notype" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for name, words in [("missing", "does not exist"), ("empty", "no config.json"), ("bad", "not valid JSON"),
                        ("notype", 'no "model_type"')]:
        info, problems = registries.read_model_dir(tmp_path / name)
        assert info is None and words in problems[0]["what"] and problems[0]["fix"]


HF = {"version": "4.57.1", "registered": {},
      "model_types": {"llama": "LlamaConfig", "mistral": "MistralConfig", "aimv2": "Aimv2Config"},
      "arch_configs": {"LlamaForCausalLM": ["LlamaConfig"], "MistralForCausalLM": ["MistralConfig"]}}
MF = {"model_types": {"llama": "LlamaConfig"}, "model_classes": {"LlamaForCausalLM": "LlamaConfig"}}


def d(path, model_type, archs, auto=None):
    return {"path": path, "model_type": model_type, "architectures": archs, "auto_config": auto}


def test_a_name_in_both_libraries_is_normal():
    dirs = [d("a", "llama", ["LlamaForCausalLM"]), d("b", "llama", ["LlamaForCausalLM"])]
    assert registries.check_model_dirs(dirs, HF, MF) == ([], [])
    assert dirs[0]["transformers_config"] == dirs[0]["mindformers_config"] == "LlamaConfig"


def test_two_dirs_claiming_one_model_type_with_different_architectures_conflict():
    problems, _ = registries.check_model_dirs([d("a", "llama", ["LlamaForCausalLM"]),
                                        d("b", "llama", ["LlamaForSequenceClassification"])], HF, MF)
    assert len(problems) == 1 and "2 model directories claim model_type 'llama'" in problems[0]["what"]


def test_a_model_type_that_resolves_to_another_config_class_is_caught():
    problems, _ = registries.check_model_dirs([d("a", "llama", ["MistralForCausalLM"])], HF, MF)
    assert "expect MistralConfig" in problems[0]["what"] and "same family" in problems[0]["fix"]


def test_a_registration_that_would_collide_is_caught_with_the_real_fixes():
    problems, _ = registries.check_model_dirs([d("x", "aimv2", ["AIMv2Model"], "configuration_aimv2.AIMv2Config")],
                                       HF, MF, COMPAT["transformers_native_since"])
    (p,) = problems
    assert "'aimv2' is already used by a Transformers config, pick another name." in p["what"]
    assert "unique model_type" in p["fix"] and "exist_ok=True" in p["fix"] and "transformers<4.54.0" in p["fix"]


def test_a_run_time_registration_over_a_native_name_is_reported():
    reg = {**HF, "registered": {"llama": "mine.MyLlamaConfig", "mylm": "mine.MyLMConfig"}}
    (w,) = registries.shadowed_registrations(reg, "transformers")
    assert "'llama'" in w["what"] and "exist_ok=True" in w["what"]


def test_importing_the_module_stays_light():
    code = ("import sys, labkit.doctor.env; heavy = [m for m in ('mindspore', 'mindformers', 'torch', 'transformers') "
            "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One real `labkit doctor --json` run with a good, a missing, a conflicting, a colliding model dir and one whose
    config.json is not JSON (doctor reports each in its table rather than stopping at the first)."""
    base = tmp_path_factory.mktemp("models")
    configs = {"good": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
               "cls": {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
               "aimv2": {"model_type": "aimv2", "architectures": ["AIMv2Model"],
                         "auto_map": {"AutoConfig": "configuration_aimv2.AIMv2Config"}}}
    for name, cfg in configs.items():
        (base / name).mkdir()
        (base / name / "config.json").write_text(json.dumps(cfg))
    (base / "badjson").mkdir()
    (base / "badjson" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    dirs = ["--model-dir", str(base / "good"), str(base / "nowhere"), str(base / "cls"), "--model-dir",
            str(base / "aimv2"), str(base / "badjson")]
    proc = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--json", *dirs], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_doctor_json_has_the_documented_keys_and_types(cli_run):
    code, out, err = cli_run
    (line,) = out.strip().splitlines()  # exactly one JSON object on stdout, also with exit status 1
    r = json.loads(line)
    for key in ("python", "mindspore", "mindformers", "torch", "transformers", "numpy"):
        assert isinstance(r[key], str) and r[key][0].isdigit(), key
    assert isinstance(r["device_targets"], list) and "CPU" in r["device_targets"]
    assert set(r["device_targets"]) <= {"CPU", "GPU", "Ascend"}
    assert r["compatible"] is True, r["problems"]  # the environment is fine; some model directories are not
    for item in r["problems"] + r["warnings"]:
        assert set(item) == {"what", "fix"} and all(isinstance(v, str) for v in item.values())
    assert "llama" in r["registries"]["in_both"]
    assert r["registries"]["model_dirs"][0]["transformers_config"] == "LlamaConfig"
    assert {"cache_dirs", "log_dirs"} <= set(r)


@pytest.mark.slow
def test_doctor_exits_1_with_readable_fixes_for_broken_and_conflicting_dirs(cli_run):
    code, out, err = cli_run
    assert code == 1 and "Traceback" not in out + err, err[-2000:]
    problems = json.loads(out)["problems"]
    whats = " | ".join(p["what"] for p in problems)
    assert len(problems) == 4, whats  # the good directory adds nothing of its own
    assert "nowhere' does not exist" in whats
    assert "badjson/config.json is not valid JSON" in whats
    assert "claim model_type 'llama' with different architectures" in whats
    assert "'aimv2' is already used by a Transformers config" in whats
    assert all(len(p["fix"]) > 20 for p in problems)


def test_doctor_exit_status_is_0_without_problems_and_1_with(monkeypatch, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    env.add_cli(parser)
    args = parser.parse_args(["--json", "--model-dir", "a", "b", "--model-dir", "c"])
    assert args.model_dirs == ["a", "b", "c"]
    seen = {}
    for problems, status in (([], 0), ([env.issue("x", "y")], 1)):
        monkeypatch.setattr(env, "doctor", lambda dirs, p=problems: seen.update(dirs=dirs) or {"problems": p})
        monkeypatch.setattr(env, "format_report", lambda r: "")
        assert args.func(args) == status and seen["dirs"] == ["a", "b", "c"]
        assert json.loads(capsys.readouterr().out) == {"problems": problems}


def test_findings_come_in_stage_order_and_only_problems_break_compatibility():
    """assess adds the judge's stages up: packages, MindSpore's table, mindformers' map, pins, devices."""
    from labkit.doctor import judge

    f = facts(versions={"torch": None, "mindspore": "2.7.2"}, hardware={"npus": ["davinci0"], "cann": "7.0"},
              devices={"CPU": {"works": False, "error": "boom"}})
    problems, warnings, ok = env.assess(f, COMPAT, VMAP)
    assert not ok
    assert [p["what"].split()[0] for p in problems] == ["torch", "mindformers", "MindSpore"]
    assert [w["what"].split()[0] for w in warnings] == ["!!!", "CANN"]
    only_devices = judge.devices(f, COMPAT, VMAP)
    assert list(only_devices.problems) == problems[-1:] and list(only_devices.warnings) == warnings[-2:]
