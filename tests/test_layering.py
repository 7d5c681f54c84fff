"""labkit's structure: layers that point down, no CLI imports in the library, no private names across modules,
no import cycle (rules in tests/layering.py), no function more complex than ruff's C901 allows (max 15, set in
pyproject.toml) and none taking more arguments than ruff's PLR0913 allows (max 8, pyproject.toml: arguments that
travel together are one object, e.g. a Layout or a LaunchSpec)."""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import layering  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_labkit_layering_holds():
    assert layering.violations(ROOT / "labkit") == []


def test_the_check_catches_a_broken_package(tmp_path):
    """A deliberately broken copy: each kind of violation is reported."""
    pkg = tmp_path / "labkit"
    for d in ("", "data", "training", "parallel", "weights"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    files = {
        "errors.py": "class LabkitError(Exception): ...\n",
        "cli.py": "def emit(): ...\n",
        "config.py": "from labkit.weights import convert\n",  # config imports a higher layer ...
        "weights/convert.py": "from labkit.config import x\n",  # ... and convert imports config: a cycle
        "data/dataset.py": "from labkit.cli import emit\nfrom labkit.parallel import planner\n"
                           "from labkit.model import llama\n",
        "parallel/planner.py": "from labkit.training.trainer import _rewrite\n",
        "training/trainer.py": "from labkit.parallel import planner\ndef _rewrite(): ...\n",
        "model/__init__.py": "", "model/llama.py": "def build():\n    from labkit.errors import LabkitError\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(textwrap.dedent(text))
    found = "\n".join(layering.violations(pkg))
    assert "config (config) imports weights.convert (domain), a higher layer" in found
    assert "import cycle: config -> weights.convert" in found
    assert "data.dataset imports the CLI" in found
    assert "data and parallel share a layer" in found
    assert "data.dataset imports model.llama: the data layer does not build a model" in found
    assert "private name training.trainer._rewrite" in found
    assert "training.trainer imports parallel.planner: the trainer does not depend on the planner" in found
    assert "model.llama imports its own package inside build()" in found


def _ruff(rule: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: make venv"
    return subprocess.run([ruff, "check", "--select", rule, "labkit"], cwd=ROOT, capture_output=True, text=True)


def test_no_function_above_the_complexity_limit():
    r = _ruff("C901")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_function_above_the_argument_limit():
    r = _ruff("PLR0913")
    assert r.returncode == 0, r.stdout + r.stderr
