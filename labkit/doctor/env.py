"""`labkit doctor`: what is installed, which device targets really work, whether the versions fit together,
and whether model-type registrations clash.

Facts are collected first (`collect_*`, `probe_devices`, `hf_registry`, `mf_registry`, `read_model_dir`), then
judged by pure functions (`assess` from labkit.doctor.judge, `check_model_dirs`, `check_environment_sync`) so tests
can feed them any machine. Each finding is `{"what": ..., "fix": ...}`: a problem (exit status 1) or a warning.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from labkit.doctor.judge import INSTALL_FIX, PACKAGES, TARGETS, assess  # noqa: F401 - assess: part of this module's API
from labkit.doctor.registries import (
    check_model_dirs,
    hf_registry,
    issue,
    mf_registry,
    read_model_dir,
    shadowed_registrations,
)
from labkit.errors import LabkitError
from labkit.output import add_common_flags, emit
from labkit.parallel.devices import cpu_matrix_isa
from labkit.paths import CONFIGS, GPU_DEVICE_FILES, NPU_DEVICE_FILES, ROOT, RUNS
from labkit.runtime import import_order_warning

SEED_CACHE = Path("~/.cache/mindspore/transformers")  # the cache directory a seed article blames (never used)


# ------------------------------------------------------------------------------------------- versions, tables


def installed_versions() -> dict:
    """Version strings (None when absent), read from package metadata without importing anything."""
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def load_compat(path: str | os.PathLike = CONFIGS / "compat.yaml") -> dict:
    import yaml


    if not Path(path).is_file():
        raise LabkitError(f"the compatibility table {path} is missing", "run from a checkout of the lab (git clone)")
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data.get("mindspore"), dict):
        raise LabkitError(f"{path}: missing the 'mindspore:' table", "restore configs/compat.yaml from git")
    return data


def version_map() -> dict | None:
    """mindformers' own VERSION_MAP.json ("mf": mindformers->mindspore, "ms": mindspore->CANN, "cann": CANN->driver),
    found without importing mindformers."""
    spec = find_spec("mindformers")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "VERSION_MAP.json"
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def lab_requirements() -> tuple[str | None, list[str]]:
    """(requires-python, dependency strings) from pyproject.toml in a checkout, else from labkit's metadata."""
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        return project.get("requires-python"), list(project.get("dependencies", []))
    try:
        meta = metadata.metadata("labkit")
        return meta.get("Requires-Python"), [r for r in metadata.requires("labkit") or [] if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        return None, []


def wheel_plugins() -> dict:
    """Which device plugins the installed MindSpore wheel carries (looked up on disk, not imported)."""
    spec = find_spec("mindspore")
    if not spec or not spec.submodule_search_locations:
        return {"cpu": False, "gpu_cuda": [], "ascend": False}
    plugin = Path(list(spec.submodule_search_locations)[0]) / "lib" / "plugin"
    cuda = sorted({m.group(1) for p in plugin.glob("libmindspore_gpu.so.*")
                   if (m := re.search(r"\.so\.(\d+\.\d+)$", p.name))}, key=lambda v: tuple(map(int, v.split("."))))
    return {"cpu": (plugin / "libmindspore_ops_cpu.so").exists() or (plugin / "cpu").is_dir(),
            "gpu_cuda": cuda, "ascend": any(plugin.glob("libmindspore_ascend.so*"))}


# ------------------------------------------------------------------------------------------ hardware, devices


def _run(cmd: list[str], timeout: float = 10) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _version_file(path: Path) -> str | None:
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            if line.lower().startswith("version="):
                return line.split("=", 1)[1].strip()
    return None


def collect_hardware() -> dict:
    """Accelerators visible to this machine, and the CUDA/CANN software found for them."""
    smi = shutil.which("nvidia-smi")
    gpus = [g.strip() for g in _run([smi, "--query-gpu=name", "--format=csv,noheader"]).splitlines()] if smi else []
    cudart = set()
    for line in _run(["ldconfig", "-p"]).splitlines():
        if m := re.search(r"libcudart\.so\.(\d+)\.(\d+)", line):
            cudart.add(f"{m.group(1)}.{m.group(2)}")
    for home in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        for p in glob.glob(f"{home}/lib*/libcudart.so.*.*"):
            if m := re.search(r"libcudart\.so\.(\d+)\.(\d+)", p):
                cudart.add(f"{m.group(1)}.{m.group(2)}")
    ascend = Path(os.environ.get("ASCEND_HOME_PATH") or "/usr/local/Ascend/ascend-toolkit/latest")
    return {
        "nvidia_gpus": [g for g in gpus if g] or [Path(p).name for p in glob.glob(GPU_DEVICE_FILES)],
        "cuda_runtimes": sorted(cudart),
        "npus": sorted(Path(p).name for p in glob.glob(NPU_DEVICE_FILES)),
        "cann": _version_file(ascend / "compiler" / "version.info"),
        "ascend_driver": _version_file(Path("/usr/local/Ascend/driver/version.info")),
        "cpu_matrix_isa": cpu_matrix_isa()["summary"],  # what a bf16/fp16 matmul can use on this CPU
    }


_PROBE = r"""
import json, sys
out = {}
try:
    import mindspore as ms
    from mindspore._c_expression import MSContext
except Exception as e:
    print("LABKIT_PROBE " + json.dumps({"import_error": f"{type(e).__name__}: {e}"})); sys.exit(0)
ctx = MSContext.get_instance()
errors = ctx.load_plugin_error().strip().splitlines()
for t in ("GPU", "Ascend", "CPU"):
    ok = bool(ctx.is_pkg_support_device(t))
    info = {"plugin_loaded": ok, "works": False, "error": ""}
    if not ok:
        info["error"] = "; ".join(e for e in errors if t.lower() in e.lower())
        try:
            ms.set_device(t)
        except Exception as e:
            info["error"] = (info["error"] + "; " if info["error"] else "") + str(e).strip().splitlines()[0]
    elif t == sys.argv[1]:
        try:
            ms.set_device(t)
            info["works"] = (ms.Tensor([1.0, 2.0]) * 2).asnumpy().tolist() == [2.0, 4.0]
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    out[t] = info
print("LABKIT_PROBE " + json.dumps(out))
"""


def _probe(target: str, timeout: float) -> dict:
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"))
    with tempfile.TemporaryDirectory(prefix="labkit-probe-") as cwd:  # MindSpore may drop files in its cwd
        try:
            proc = subprocess.run([sys.executable, "-c", _PROBE, target], capture_output=True, text=True,
                                  timeout=timeout, cwd=cwd, env=env, check=False)
        except subprocess.TimeoutExpired:
            return {"import_error": f"the device probe took more than {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("LABKIT_PROBE "):
            return json.loads(line[len("LABKIT_PROBE "):])
    return {"import_error": f"the device probe exited with status {proc.returncode}: {proc.stderr.strip()[-300:]}"}


def probe_devices(timeout: float = 240) -> dict:
    """Try each target for real, each in a fresh process (a device choice is final in a MindSpore process):
    the plugin must load and a tiny multiplication must give the right answer."""
    first = _probe("CPU", timeout)
    if "import_error" in first:
        return {t: {"plugin_loaded": False, "works": False, "error": first["import_error"]} for t in TARGETS}
    for t in ("GPU", "Ascend"):
        if first[t]["plugin_loaded"]:
            first[t] = _probe(t, timeout).get(t, {"plugin_loaded": True, "works": False, "error": "probe failed"})
    return first


# ------------------------------------------------------------------------------------------ environment sync


def check_environment_sync(pyproject: str | os.PathLike = ROOT / "pyproject.toml",
                           environment: str | os.PathLike = ROOT / "environment.yml") -> list[dict]:
    """environment.yml must give conda only Python (a version pyproject's requires-python accepts) and pip, and
    install this package with exactly the extras pyproject.toml declares. Returns the drifts found."""
    import tomllib

    import yaml
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads(Path(pyproject).read_text(encoding="utf-8")).get("project", {})
    env = yaml.safe_load(Path(environment).read_text(encoding="utf-8")) or {}
    requires = SpecifierSet(project.get("requires-python", ""))
    extras = set(project.get("optional-dependencies", {}))
    found, pip_lines, python = [], [], None
    for dep in env.get("dependencies") or []:
        if isinstance(dep, dict) and set(dep) == {"pip"}:
            pip_lines += [str(x).strip() for x in dep["pip"] or []]
        elif isinstance(dep, str) and re.match(r"^python\b", dep.strip()):
            python = dep.strip()
        elif isinstance(dep, str) and dep.strip() != "pip":
            found.append(issue(f"environment.yml installs '{dep}' with conda",
                               "keep every pin in pyproject.toml; conda provides only python and pip"))
    m = re.match(r"^python\s*=?=\s*(\d+\.\d+)(?:\.[\d*]+)?$", python or "")
    if not m:
        found.append(issue(f"environment.yml: python entry {python!r} does not pin a version like python=3.11",
                           f"write python=X.Y with a version pyproject.toml accepts ({requires})"))
    elif not requires.contains(f"{m.group(1)}.0"):
        found.append(issue(f"environment.yml asks for python {m.group(1)} but pyproject.toml requires-python is "
                           f"'{requires}'", "change one so both name the same Python version"))
    editable = [line for line in pip_lines if re.match(r"^-e\s+\.(\[.*\])?$", line)]
    if len(editable) != 1:
        found.append(issue("environment.yml: the pip section must install this package once, as `-e .[...]`",
                           f"write `- -e .[{','.join(sorted(extras))}]` under pip:"))
    else:
        named = set(filter(None, re.sub(r"^-e\s+\.", "", editable[0]).strip("[]").replace(" ", "").split(",")))
        if named != extras:
            found.append(issue(f"environment.yml installs extras {sorted(named)} but pyproject.toml declares "
                               f"{sorted(extras)}", f"write `- -e .[{','.join(sorted(extras))}]` under pip:"))
    for line in pip_lines:
        if line not in editable:
            found.append(issue(f"environment.yml: pip installs '{line}' directly",
                               "move the requirement into pyproject.toml (dependencies or an extra)"))
    return found


# ---------------------------------------------------------------------------------------------- directories


def cache_and_log_dirs() -> tuple[dict, dict]:
    """Where the libraries cache downloads and write logs, as this process would resolve them."""
    def entry(path, why):
        if path == "stderr":
            return {"path": path, "exists": None, "what": why}
        p = Path(path).expanduser()
        return {"path": str(p), "exists": p.exists(), "what": why}

    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    hf_home = Path(os.environ.get("HF_HOME") or xdg / "huggingface").expanduser()
    caches = {
        "huggingface_hub": entry(os.environ.get("HF_HUB_CACHE") or hf_home / "hub",
                                 "models and tokenizers downloaded by transformers (this lab downloads none)"),
        "huggingface_modules": entry(os.environ.get("HF_MODULES_CACHE") or hf_home / "modules",
                                     "model code loaded with trust_remote_code"),
        "torch": entry(os.environ.get("TORCH_HOME") or xdg / "torch", "torch hub downloads"),
        "mindformers_checkpoint_download": entry(Path.cwd() / "checkpoint_download",
                                                 "mindformers' default download folder (relative to the cwd)"),
        "mindspore_compile_cache": entry(os.environ.get("MS_COMPILER_CACHE_PATH") or Path.cwd() / "kernel_meta",
                                         "graph compile cache (MS_COMPILER_CACHE_PATH; default in the cwd)"),
        "seed_claim_mindspore_transformers": entry(SEED_CACHE, "named by a seed article; neither MindSpore nor "
                                                   "mindformers reads or writes it"),
    }
    logs = {
        "mindformers": entry(os.environ.get("LOG_MF_PATH") or Path.cwd() / "output" / "log",
                             "mindformers file logs (LOG_MF_PATH; default ./output/log in the cwd)"),
        "mindspore": entry(os.environ.get("GLOG_log_dir") or "stderr",
                           f"MindSpore C++ log (GLOG_log_dir; level GLOG_v={os.environ.get('GLOG_v', '2')})"),
        "labkit_runs": entry(RUNS, "everything the lab writes"),
    }
    return caches, logs


# --------------------------------------------------------------------------------------------- the whole check


def doctor(model_dirs: list[str] | tuple = (), *, devices: bool = True, registries: bool = True) -> dict:
    """Collect everything and judge it. The returned dict is what `labkit doctor --json` prints."""
    compat, vmap = load_compat(), version_map()
    requires_python, deps = lab_requirements()
    pool = ThreadPoolExecutor(1)  # the device probe runs in child processes while the registries load here
    probe = pool.submit(probe_devices) if devices else None
    facts = {"versions": installed_versions(), "requires_python": requires_python, "dependencies": deps,
             "plugins": wheel_plugins(), "hardware": collect_hardware()}
    dirs, reg, found = [], {}, []
    for path in model_dirs:
        info, bad = read_model_dir(path)
        found += bad
        dirs += [info] if info else []
    # mindformers first: transformers' run-time registrations then include any that importing mindformers made
    mf = mf_registry() if (registries or dirs) and facts["versions"]["mindformers"] else None
    hf = hf_registry() if (registries or dirs) and facts["versions"]["transformers"] else None
    facts["devices"] = probe.result() if probe else {t: {"plugin_loaded": None, "works": t == "CPU",
                                                         "error": "not probed"} for t in TARGETS}
    pool.shutdown()
    problems, warnings, compatible = assess(facts, compat, vmap)
    problems += found
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "environment.yml").is_file():
        warnings += check_environment_sync()
    if hf or mf:
        if hf:
            p, w = check_model_dirs(dirs, hf, mf, compat.get("transformers_native_since"))
            problems, warnings = problems + p, warnings + w + shadowed_registrations(hf, "transformers")
        if mf:
            warnings += shadowed_registrations(mf, "mindformers")
        both = sorted(set(hf["model_types"]) & set(mf["model_types"])) if hf and mf else []
        reg = {"transformers": hf and {"version": hf["version"], "model_types": len(hf["model_types"]),
                                       "registered_at_run_time": hf["registered"]},
               "mindformers": mf and {k: mf[k] for k in ("version", "auto_config_model_types", "config_classes",
                                                         "registered")} | {"model_types": sorted(mf["model_types"])},
               "in_both": both, "model_dirs": dirs}
    late = import_order_warning()  # this process (a notebook's kernel) imported MindSpore before it was prepared
    warnings += [late] if late else []
    caches, logs = cache_and_log_dirs()
    return {**facts["versions"], "device_targets": [t for t in TARGETS if facts["devices"][t]["works"]],
            "compatible": compatible, "problems": problems, "warnings": warnings, "ok": not problems,
            "devices": facts["devices"], "hardware": facts["hardware"], "wheel_plugins": facts["plugins"],
            "requires_python": requires_python, "version_map": _vmap_rows(vmap, facts["versions"]),
            "registries": reg, "cache_dirs": caches, "log_dirs": logs}


def _vmap_rows(vmap: dict | None, v: dict) -> dict | None:
    """The VERSION_MAP.json chain for what is installed: mindformers -> mindspore -> CANN -> driver."""
    if not vmap:
        return None
    mf = vmap.get("mf", {}).get(v.get("mindformers") or "", {})
    ms = vmap.get("ms", {}).get(v.get("mindspore") or "", {})
    return {"mindformers_needs_mindspore": mf.get("support"), "mindspore_needs_cann": ms.get("support"),
            "cann_needs_driver": vmap.get("cann", {}).get(ms.get("prefer", ""), {}).get("support")}


# ------------------------------------------------------------------------------------------------- reporting


def format_report(r: dict) -> str:
    lines = ["labkit doctor", ""]
    lines += [f"  {k:<13}{r[k] or 'not installed'}" for k in ("python",) + PACKAGES]
    lines += ["", "device targets that work here: " + (", ".join(r["device_targets"]) or "none")]
    for t, d in r["devices"].items():
        if not d["works"] and d.get("error"):
            lines.append(f"  {t:<7} no: {d['error'][:160]}")
    hw = r["hardware"]
    lines.append(f"accelerators visible: NVIDIA {hw['nvidia_gpus'] or 'none'}, Ascend NPU {hw['npus'] or 'none'}")
    lines.append(f"CPU matrix instructions: {hw.get('cpu_matrix_isa') or 'unknown'}")
    wp = r["wheel_plugins"]
    lines.append(f"wheel plugins: CPU {'yes' if wp['cpu'] else 'no'}, GPU for CUDA {', '.join(wp['gpu_cuda']) or '-'}"
                 f", Ascend {'yes' if wp['ascend'] else 'no'}")
    if r["version_map"]:
        vm = r["version_map"]
        lines.append(f"VERSION_MAP.json: mindformers {r['mindformers']} -> mindspore "
                     f"{vm['mindformers_needs_mindspore']} -> CANN {vm['mindspore_needs_cann']} -> driver "
                     f"{vm['cann_needs_driver']}")
    reg = r["registries"]
    if reg:
        tf, mf = reg["transformers"] or {}, reg["mindformers"] or {}
        lines.append(f"registries: transformers {tf.get('version')} {tf.get('model_types')} model types; "
                     f"mindformers {mf.get('version')} {len(mf.get('model_types', []))} model types; "
                     f"in both (normal): {', '.join(reg['in_both']) or 'none'}")
        for d in reg["model_dirs"]:
            lines.append(f"  {d['path']}: model_type {d['model_type']} -> transformers {d['transformers_config']}, "
                         f"mindformers {d['mindformers_config']}; architectures {d['architectures']}")
    lines.append("caches / logs:")
    for k, d in {**r["cache_dirs"], **r["log_dirs"]}.items():
        lines.append(f"  {k:<34}{d['path']}{'  (absent)' if d['exists'] is False else ''}")
    for title, items in (("PROBLEMS", r["problems"]), ("warnings", r["warnings"])):
        if items:
            lines += ["", f"{title}:"] + [f"  - {i['what']}\n    fix: {i['fix']}" for i in items]
    lines += ["", f"verdict: {'compatible' if r['compatible'] else 'NOT compatible'}; "
                  f"{len(r['problems'])} problem(s), {len(r['warnings'])} warning(s)"]
    return "\n".join(lines)


def run_python(code: str, *, home: str | os.PathLike | None = None, timeout: float = 300,
               cwd: str | os.PathLike | None = None) -> dict:
    """Run a snippet in a fresh interpreter (a clean registry, and HOME pointed elsewhere if asked).
    Returns {returncode, stdout, stderr, error}: `error` is the last line of a traceback, if any."""
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"), PYTHONUNBUFFERED="1")
    if home is not None:
        env["HOME"] = str(home)
        env.pop("XDG_CACHE_HOME", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env, check=False)
    tb = proc.stderr.strip().splitlines()
    error = tb[-1] if proc.returncode and tb else ""
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "error": error}


def add_cli(parser) -> None:
    parser.add_argument("--model-dir", dest="model_dirs", action="extend", nargs="+", default=[], metavar="PATH",
                        help="a Hugging Face model directory to check (config.json model_type/architectures)")
    add_common_flags(parser)
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    report = doctor(args.model_dirs)
    emit(args, report, format_report(report))
    return 0 if not report["problems"] else 1
