"""labkit/__init__.py: on a machine without accelerator devices, importing labkit makes MindSpore launch operators
synchronously (MS_DEV_LAUNCH_BLOCKING=1) before MindSpore starts; a value already set wins. The speed it buys is
measured by bench/pynative_launch.py, not here."""
import os
import subprocess
import sys

import pytest

from labkit.paths import ROOT, accelerator_device_files

PROBE = "import os, labkit, mindspore; print(os.environ.get('MS_DEV_LAUNCH_BLOCKING'))"


def _probe(**env):
    base = {k: v for k, v in os.environ.items() if k != "MS_DEV_LAUNCH_BLOCKING"}
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**base, "GLOG_v": "3", **env})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(bool(accelerator_device_files()),
                    reason="this machine has accelerator devices: labkit leaves MindSpore's launch mode alone")
def test_importing_labkit_on_a_cpu_only_machine_sets_blocking_launch():
    assert _probe() == "1"


def test_a_launch_mode_the_user_chose_is_kept():
    assert _probe(MS_DEV_LAUNCH_BLOCKING="0") == "0"
