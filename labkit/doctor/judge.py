"""The doctor's judgement of collected facts (pure: tests feed it any machine). Each stage looks at one part of the
facts and returns Findings; `assess` adds them up in a fixed order (packages, MindSpore's table, mindformers' map,
the lab's pins, devices)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata

from labkit.doctor.registries import issue

PACKAGES = ("mindspore", "mindformers", "torch", "transformers", "numpy")
TARGETS = ("CPU", "GPU", "Ascend")
INSTALL_FIX = "recreate the environment from the lab's pins: `make venv` (or pip install -e '.[lab,test]')"


@dataclass(frozen=True)
class Findings:
    problems: tuple = ()  # {"what", "fix"} that make `labkit doctor` exit 1
    warnings: tuple = ()

    def __add__(self, other: Findings) -> Findings:
        return Findings(self.problems + other.problems, self.warnings + other.warnings)


def assess(facts: dict, compat: dict, vmap: dict | None) -> tuple[list[dict], list[dict], bool]:
    """Judge the collected facts: (problems, warnings, compatible). `compatible` is False only when the
    versions or devices cannot work together (model-directory problems do not touch it)."""
    v = facts["versions"]
    found = (packages(v, facts.get("requires_python")) + mindspore_row(v, compat) + mindformers_map(v, vmap)
             + pins(facts.get("dependencies", [])) + devices(facts, compat, vmap))
    return list(found.problems), list(found.warnings), not found.problems


def packages(v: dict, requires_python: str | None) -> Findings:
    """The lab's packages are installed, and Python is inside the lab's requires-python."""
    from packaging.specifiers import SpecifierSet

    problems = [issue(f"{name} is not installed in {sys.prefix}", INSTALL_FIX) for name in PACKAGES
                if v.get(name) is None]
    if requires_python and not SpecifierSet(requires_python).contains(v["python"]):
        problems.append(issue(f"Python {v['python']} is outside the lab's requires-python '{requires_python}'",
                              "create the environment with Python 3.11 (`make venv PYTHON=python3.11`)"))
    return Findings(problems=tuple(problems))


def mindspore_row(v: dict, compat: dict) -> Findings:
    """The installed MindSpore is in configs/compat.yaml and has a wheel for this Python."""
    ms, py_minor = v.get("mindspore"), ".".join(v["python"].split(".")[:2])
    row = compat["mindspore"].get(ms) if ms else None
    if ms and row is None:
        return Findings(warnings=(issue(f"mindspore {ms} is not in the lab's table (configs/compat.yaml)",
                                        "use the pinned mindspore, or add a row with its sources"),))
    if row and py_minor not in row.get("python", []):
        return Findings(problems=(issue(f"mindspore {ms} has no wheel for Python {py_minor} (wheels: "
                                        f"{row['python']})", f"use Python {row['python'][-1]} or another mindspore "
                                        "release"),))
    return Findings()


def mindformers_map(v: dict, vmap: dict | None) -> Findings:
    """mindformers' own VERSION_MAP.json lists the installed MindSpore as supported."""
    ms, mf = v.get("mindspore"), v.get("mindformers")
    if not (mf and ms and vmap):
        return Findings()
    entry = vmap.get("mf", {}).get(mf)
    if entry is None:
        return Findings(warnings=(issue(f"mindformers {mf} is not in its own VERSION_MAP.json", INSTALL_FIX),))
    if ms not in entry.get("support", []):
        return Findings(problems=(issue(f"mindformers {mf} supports mindspore {entry['support']} (VERSION_MAP.json),"
                                        f" but mindspore {ms} is installed",
                                        f"pip install mindspore=={entry['prefer']}"),))
    return Findings()


def pins(deps: list[str]) -> Findings:
    """Every pinned dependency is installed at a version its pin allows (drift is a warning)."""
    from packaging.requirements import Requirement

    warnings = []
    for dep in deps:
        req = Requirement(dep)
        if req.marker or not req.specifier:
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            if req.name not in PACKAGES:
                warnings.append(issue(f"{req.name} (pinned {req.specifier}) is not installed", INSTALL_FIX))
            continue
        if not req.specifier.contains(have, prereleases=True):
            warnings.append(issue(f"{req.name} {have} does not match the lab's pin {req.specifier}", INSTALL_FIX))
    return Findings(warnings=tuple(warnings))


def devices(facts: dict, compat: dict, vmap: dict | None) -> Findings:
    """MindSpore runs on CPU; a visible GPU or NPU it cannot use is a loud warning; CANN matches MindSpore."""
    dev, hw, ms = facts["devices"], facts["hardware"], facts["versions"].get("mindspore")
    problems = []
    if not dev["CPU"]["works"]:
        problems.append(issue(f"MindSpore cannot run on CPU here: {dev['CPU']['error'] or 'the probe failed'}",
                              INSTALL_FIX))
    cuda_ok = compat["mindspore"].get(ms, {}).get("cuda") or facts["plugins"]["gpu_cuda"]
    warnings = [unused_gpu(dev, hw, ms, cuda_ok)] if hw["nvidia_gpus"] and not dev["GPU"]["works"] else []
    return Findings(tuple(problems), tuple(warnings)) + ascend(dev, hw, ms, vmap)


def unused_gpu(dev: dict, hw: dict, ms: str | None, cuda_ok: list) -> dict:
    found = ", ".join(hw["cuda_runtimes"]) or "none found"
    return issue(
        f"!!! An NVIDIA GPU is visible ({', '.join(hw['nvidia_gpus'])}) but MindSpore can only use "
        f"{', '.join(t for t in TARGETS if dev[t]['works']) or 'nothing'}: training would run on CPU, tens of "
        f"times slower. The mindspore {ms} wheel has GPU plugins for CUDA {', '.join(cuda_ok) or 'none'}; "
        f"CUDA runtime here: {found}. {dev['GPU']['error']}".strip(),
        f"install a CUDA runtime the wheel supports ({' or '.join(cuda_ok) or 'see mindspore.cn/install'}) with "
        "its cuDNN, put its lib64 on LD_LIBRARY_PATH, and check with "
        "`python -c \"import mindspore as ms; ms.set_device('GPU'); ms.run_check()\"`")


def ascend(dev: dict, hw: dict, ms: str | None, vmap: dict | None) -> Findings:
    """A visible NPU that MindSpore cannot use, and a CANN that is not the one MindSpore expects."""
    cann_row = (vmap or {}).get("ms", {}).get(ms, {}) if ms else {}
    warnings = []
    if hw["npus"] and not dev["Ascend"]["works"]:
        warnings.append(issue(
            f"!!! An Ascend NPU is visible ({len(hw['npus'])} device(s)) but MindSpore cannot use it: training "
            f"would run on CPU, tens of times slower. CANN here: {hw['cann'] or 'not found'}. "
            f"{dev['Ascend']['error']}".strip(),
            f"install CANN {cann_row.get('prefer', '(see VERSION_MAP.json)')} for mindspore {ms} and "
            "`source <ascend-toolkit>/set_env.sh` before starting Python"))
    if hw["cann"] and cann_row and not any(hw["cann"].startswith(s) for s in cann_row.get("support", [])):
        driver = (vmap or {}).get("cann", {}).get(cann_row["prefer"], {}).get("prefer", "?")
        warnings.append(issue(f"CANN {hw['cann']} is installed; mindspore {ms} expects {cann_row['support']} "
                              "(VERSION_MAP.json)", f"install CANN {cann_row['prefer']} with driver {driver}"))
    return Findings(warnings=tuple(warnings))
