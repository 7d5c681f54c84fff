"""pyproject.toml is the single source of pins; environment.yml gives conda only Python and pip and installs the
package with its extras. These tests fail when the two drift, and show that the checker does catch a drift."""
import re
import shutil

import pytest

from labkit.doctor.env import check_environment_sync
from labkit.paths import ROOT

PYPROJECT, ENVIRONMENT = ROOT / "pyproject.toml", ROOT / "environment.yml"


@pytest.fixture
def copies(tmp_path):
    """Editable copies of both files."""
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    shutil.copy(ENVIRONMENT, tmp_path / "environment.yml")
    return tmp_path / "pyproject.toml", tmp_path / "environment.yml"


def edit(path, pattern, repl):
    text = path.read_text(encoding="utf-8")
    new, n = re.subn(pattern, repl, text, flags=re.M)
    assert n, f"{pattern!r} not found in {path.name}: the test needs updating with the file"
    path.write_text(new, encoding="utf-8")


def whats(found):
    return " | ".join(f["what"] for f in found)


def test_repository_files_agree():
    found = check_environment_sync(PYPROJECT, ENVIRONMENT)
    assert found == [], "\n".join(f"{f['what']}\n  fix: {f['fix']}" for f in found)


def test_a_changed_python_in_environment_yml_is_caught(copies):
    pyproject, env = copies
    edit(env, r"^(\s*- python)=3\.11\s*$", r"\1=3.12")
    found = check_environment_sync(pyproject, env)
    assert "python 3.12" in whats(found) and "requires-python" in whats(found)


def test_a_changed_requires_python_is_caught(copies):
    pyproject, env = copies
    edit(pyproject, r'^requires-python = ".*"$', 'requires-python = ">=3.12,<3.13"')
    assert "python 3.11" in whats(check_environment_sync(pyproject, env))


def test_an_unpinned_python_is_caught(copies):
    pyproject, env = copies
    edit(env, r"^(\s*- python)=3\.11\s*$", r"\1")
    assert "does not pin a version" in whats(check_environment_sync(pyproject, env))


def test_a_new_extra_in_pyproject_is_caught(copies):
    pyproject, env = copies
    edit(pyproject, r"^\[project\.optional-dependencies\]$", '[project.optional-dependencies]\ndocs = ["sphinx"]')
    found = check_environment_sync(pyproject, env)
    assert "docs" in whats(found) and "-e .[docs,lab,test]" in found[0]["fix"]


def test_an_extra_dropped_from_environment_yml_is_caught(copies):
    pyproject, env = copies
    edit(env, r"-e \.\[lab,test\]", "-e .[lab]")
    assert "extras ['lab']" in whats(check_environment_sync(pyproject, env))


def test_pins_outside_pyproject_are_caught(copies):
    pyproject, env = copies
    edit(env, r"^(\s*)- pip\s*$", r"\1- pip\n\1- numpy=1.26")
    edit(env, r"^(\s*)- -e \.\[lab,test\]\s*$", r"\1- -e .[lab,test]\n\1- torch==2.13.0")
    found = whats(check_environment_sync(pyproject, env))
    assert "'numpy=1.26' with conda" in found and "pip installs 'torch==2.13.0'" in found
