"""labkit.runtime: importing labkit changes nothing in a process; `prepare_process` sets what a process on a device
target needs, keeps what the user set, and any import order of labkit, MindSpore and TensorBoard works.

Each case runs in a fresh interpreter whose environment has none of the settings (the suite's own process was
prepared by conftest.py). The speed that launch blocking buys is measured by bench/pynative_launch.py, not here."""
import json
import os
import subprocess
import sys

import pytest

from labkit.errors import LabkitError
from labkit.paths import ROOT
from labkit.runtime import process_env

SETTINGS = ("MS_DEV_LAUNCH_BLOCKING", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "GLOG_v", "LOG_MF_PATH",
            "TQDM_MININTERVAL", "USE_TORCH")


def _python(code: str, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**base, **env})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


IMPORT_EVERYTHING = """
import importlib, json, os, pkgutil, sys
env, meta_path = dict(os.environ), list(sys.meta_path)
import labkit
names = [m.name for m in pkgutil.walk_packages(labkit.__path__, "labkit.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
from google.protobuf.internal import api_implementation  # protobuf's backend, as chosen without any setting
stand_ins = [n for n, m in sys.modules.items() if m is None or type(m).__name__ == "_StandIn"]
print(json.dumps({"modules": len(names), "env_changed": sorted(set(env.items()) ^ set(os.environ.items())),
                  "meta_path_changed": list(sys.meta_path) != meta_path, "stand_ins": stand_ins,
                  "protobuf": api_implementation.Type()}))
"""


def test_importing_every_labkit_module_changes_nothing_in_the_process():
    clean = _python("from google.protobuf.internal import api_implementation; import json; "
                    "print(json.dumps({'protobuf': api_implementation.Type()}))")
    r = _python(IMPORT_EVERYTHING)
    assert r["modules"] > 80  # the walk found the package, not an empty path
    assert r["env_changed"] == []
    assert not r["meta_path_changed"] and r["stand_ins"] == []
    assert r["protobuf"] == clean["protobuf"]


def test_settings_follow_the_device_target_and_a_bad_target_is_refused():
    assert process_env("CPU")["MS_DEV_LAUNCH_BLOCKING"] == "1"
    for target in ("Ascend", "GPU"):  # asynchronous launches overlap host and device work there
        assert "MS_DEV_LAUNCH_BLOCKING" not in process_env(target)
    assert "USE_TORCH" not in process_env("CPU") and process_env("CPU", torch=False)["USE_TORCH"] == "0"
    with pytest.raises(LabkitError, match="device_target 'cpu'"):
        process_env("cpu")


PREPARED = """
import json, os
from labkit.runtime import prepare_process
set_now = prepare_process({target!r})
import mindspore
print(json.dumps({{"set": sorted(set_now), "blocking": os.environ.get("MS_DEV_LAUNCH_BLOCKING")}}))
"""


@pytest.mark.slow
def test_prepare_process_sets_what_the_target_needs_and_keeps_what_the_user_set():
    cpu = _python(PREPARED.format(target="CPU"))
    assert cpu["blocking"] == "1" and "MS_DEV_LAUNCH_BLOCKING" in cpu["set"]
    mine = _python(PREPARED.format(target="CPU"), MS_DEV_LAUNCH_BLOCKING="0")
    assert mine["blocking"] == "0" and "MS_DEV_LAUNCH_BLOCKING" not in mine["set"]
    ascend = _python(PREPARED.format(target="Ascend"))  # only the settings: no device is needed to prepare
    assert ascend["blocking"] is None


ORDERS = {  # each ends by importing MindSpore's checkpoint protobuf module, which needs the pure-Python backend
    "TensorBoard's reader and writer first": "from labkit.training.tensorboard import EventWriter, read_scalars\n"
                                             "EventWriter(out).add({'step': 1, 'loss': 2.0}); read_scalars(out)\n"
                                             "import mindspore",
    "MindSpore first": "import mindspore\nfrom labkit.training.tensorboard import EventWriter, read_scalars\n"
                       "EventWriter(out).add({'step': 1, 'loss': 2.0}); read_scalars(out)",
    "a prepared process, tensorboardX first": "from labkit.runtime import prepare_process; prepare_process()\n"
                                              "import tensorboardX, tensorboard\nimport mindspore",
}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.slow
def test_any_import_order_of_labkit_mindspore_and_tensorboard_works(order, tmp_path):
    code = (f"import json, pathlib\nout = pathlib.Path({str(tmp_path)!r})\n{ORDERS[order]}\n"
            "from mindspore.train import checkpoint_pb2\nprint(json.dumps({'ok': hasattr(checkpoint_pb2, 'Checkpoint')}))")
    assert _python(code) == {"ok": True}


@pytest.mark.slow
def test_doctor_names_settings_that_came_after_mindspore():
    code = ("import json, mindspore\nfrom labkit.runtime import prepare_process, import_order_warning\n"
            "prepare_process('CPU')\nprint(json.dumps(import_order_warning()))")
    late = _python(code)
    assert "MS_DEV_LAUNCH_BLOCKING" in late["what"] and "prepare_process" in late["fix"]
    assert _python("import json\nfrom labkit.runtime import prepare_process, import_order_warning\n"
                   "prepare_process('CPU')\nimport mindspore\nprint(json.dumps(import_order_warning()))") is None
