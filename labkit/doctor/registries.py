"""Model-name registries: which model types HF transformers and mindformers register, model folders whose
`model_type` or `auto_map` would clash with them, and registrations one library shadows in the other."""
from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

from labkit.logs import quiet_mindformers
from labkit.output import stdout_to_stderr


def hf_registry() -> dict:
    """HF transformers' AutoConfig names: model_type -> config class, plus names registered at run time."""
    from transformers.models.auto import configuration_auto as ca
    from transformers.models.auto import modeling_auto as ma

    native = dict(ca.CONFIG_MAPPING_NAMES)
    arch_configs: dict[str, set] = {}
    for name in dir(ma):
        if name.endswith("_MAPPING_NAMES"):
            for mt, classes in getattr(ma, name).items():
                for c in classes if isinstance(classes, (list, tuple)) else [classes]:
                    if mt in native:
                        arch_configs.setdefault(c, set()).add(native[mt])
    extra = {k: f"{v.__module__}.{v.__qualname__}" for k, v in ca.CONFIG_MAPPING._extra_content.items()}
    return {"version": metadata.version("transformers"), "model_types": native, "registered": extra,
            "arch_configs": {k: sorted(v) for k, v in arch_configs.items()}}


def mf_registry() -> dict:
    """mindformers' names: its AutoConfig model types and the classes in MindFormerRegister."""
    quiet_mindformers()

    with stdout_to_stderr():  # mindformers prints import warnings on stdout
        from mindformers.models.auto import configuration_auto as mca
        from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    reg = MindFormerRegister.registry
    configs = {name: getattr(cls, "model_type", None) for name, cls in reg.get(MindFormerModuleType.CONFIG, {}).items()}
    models = {name.removeprefix("mcore_"): getattr(getattr(cls, "config_class", None), "__name__", None)
              for name, cls in reg.get(MindFormerModuleType.MODELS, {}).items()}
    model_types = dict(mca.CONFIG_MAPPING_NAMES)
    for name, mt in configs.items():
        if isinstance(mt, str) and mt:
            model_types.setdefault(mt, name.removeprefix("mcore_"))
    extra = {k: f"{v.__module__}.{v.__qualname__}" for k, v in mca.CONFIG_MAPPING._extra_content.items()}
    return {"version": metadata.version("mindformers"), "model_types": model_types,
            "auto_config_model_types": sorted(mca.CONFIG_MAPPING_NAMES), "config_classes": sorted(configs),
            "model_classes": models, "registered": extra}


def read_model_dir(path: str | os.PathLike) -> tuple[dict | None, list[dict]]:
    """(facts from config.json, problems). A directory is judged by its config.json alone."""
    p = Path(path).expanduser()
    cfg_file = p / "config.json"
    if not p.is_dir():
        return None, [issue(f"model directory '{path}' does not exist (looked in {p.resolve()})",
                            "check the path (relative paths start at the current directory) or create the "
                            "checkpoint there first, e.g. with `labkit convert`")]
    if not cfg_file.is_file():
        return None, [issue(f"model directory '{path}' has no config.json",
                            "point --model-dir at a Hugging Face model directory (save_pretrained() writes "
                            "config.json), not at its parent or at a checkpoint file")]
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, [issue(f"{cfg_file} is not valid JSON: {e}", "repair the file (or write it again with "
                                                                   "config.save_pretrained())")]
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str) or not cfg.get("model_type"):
        return None, [issue(f"{cfg_file} has no \"model_type\"",
                            'add the family name, e.g. "model_type": "llama"; AutoConfig picks the config class '
                            "from it")]
    archs = cfg.get("architectures") or []
    auto_config = (cfg.get("auto_map") or {}).get("AutoConfig") if isinstance(cfg.get("auto_map"), dict) else None
    if isinstance(auto_config, list):
        auto_config = auto_config[0]
    return {"path": str(path), "model_type": cfg["model_type"],
            "architectures": [a for a in archs if isinstance(a, str)], "auto_config": auto_config}, []


def check_model_dirs(dirs: list[dict], hf: dict, mf: dict | None, native_since: dict | None = None
                     ) -> tuple[list[dict], list[dict]]:
    """Judge model directories against both registries. Returns (problems, warnings); adds to each dir
    the config class its model_type resolves to in transformers and in mindformers."""
    problems, warnings = [], []
    hf_types, mf_types = hf["model_types"], (mf or {}).get("model_types", {})
    mf_models = (mf or {}).get("model_classes", {})
    for d in dirs:
        mt, where = d["model_type"], f"{d['path']}/config.json"
        d["transformers_config"] = hf_types.get(mt) or hf.get("registered", {}).get(mt)
        d["mindformers_config"] = mf_types.get(mt)
        if d["auto_config"]:
            custom = d["auto_config"].rsplit(".", 1)[-1]
            clash = [lib for lib, names in (("transformers", hf_types), ("mindformers", mf_types)) if mt in names]
            if clash:
                since = (native_since or {}).get(mt)
                pin = f"; or pin transformers<{since}, the last releases without a native '{mt}'" if since else ""
                problems.append(issue(
                    f"{where}: model_type '{mt}' is native in {' and '.join(clash)} (as "
                    f"{hf_types.get(mt) or mf_types.get(mt)}), but this directory brings its own {custom} "
                    f"(auto_map): AutoConfig.register('{mt}', {custom}) raises \"'{mt}' is already used by a "
                    f"Transformers config, pick another name.\", and without trust_remote_code the native class "
                    f"is loaded instead",
                    f"give the custom model a unique model_type (in config.json and in {custom}.model_type, e.g. "
                    f"'myorg_{mt}'); or register with exist_ok=True in exactly one place, knowing it replaces the "
                    f"native class for the whole process{pin}"))
            continue
        expected = set()
        for arch in d["architectures"]:
            expected |= set(hf["arch_configs"].get(arch, []))
            if mf_models.get(arch):
                expected.add(mf_models[arch])
        resolved = {c for c in (d["transformers_config"], d["mindformers_config"]) if isinstance(c, str)}
        if not resolved:
            problems.append(issue(
                f"{where}: model_type '{mt}' is unknown to transformers {hf['version']} and to mindformers",
                "use the model_type of the family the weights belong to (e.g. 'llama'), or ship the config class "
                "with the model (auto_map + trust_remote_code)"))
        elif expected and not (expected & resolved):
            problems.append(issue(
                f"{where}: model_type '{mt}' resolves to {' / '.join(sorted(resolved))}, but its architectures "
                f"{d['architectures']} expect {' or '.join(sorted(expected))}",
                "make model_type and architectures name the same family (e.g. 'llama' with LlamaForCausalLM); "
                "a wrong model_type silently builds the wrong config class"))
        elif d["architectures"] and not expected:
            warnings.append(issue(
                f"{where}: architectures {d['architectures']} are known to neither transformers {hf['version']} "
                "nor mindformers", "check the spelling, or ship the model code with the checkpoint (auto_map)"))
    by_type: dict[str, list[dict]] = {}
    for d in dirs:
        by_type.setdefault(d["model_type"], []).append(d)
    for mt, group in by_type.items():
        if len({tuple(sorted(d["architectures"])) for d in group}) > 1:
            listing = "; ".join(f"{d['path']}: {d['architectures']}" for d in group)
            problems.append(issue(
                f"{len(group)} model directories claim model_type '{mt}' with different architectures ({listing})",
                "give each model its own model_type (AutoConfig maps one name to one config class), or fix the "
                "directory whose architectures are wrong"))
    return problems, warnings


def shadowed_registrations(reg: dict, lib: str) -> list[dict]:
    """Names registered at run time (exist_ok=True) over a native name: legal, and a trap."""
    return [issue(f"{lib}: native model_type '{k}' is replaced in this process by {v} (registered with exist_ok=True)",
                  f"register the custom class under its own name instead of '{k}'")
            for k, v in reg.get("registered", {}).items() if k in reg["model_types"]]


def issue(what: str, fix: str) -> dict:
    return {"what": what, "fix": fix}
