"""What a lab process sets before MindSpore starts, in one place, called explicitly.

Importing a labkit module changes nothing in the process. The entry points call `prepare_process(device_target)`
once, before anything imports MindSpore: the command line (`labkit ...`), the msrun worker and probe entries, the
by-hand parallel workers, the notebooks' `nb.setup`, and the launcher, which hands the same settings to its workers
through their environment (`process_env`). A value the user already set always wins.

The settings, and why each is set here:
- `MS_DEV_LAUNCH_BLOCKING=1`, on the CPU target only. MindSpore runs PyNative (eager) operators through queue threads
  (frontend, backend, bprop) that spin while they wait; on a machine with few cores they take the cores the operators
  need. With launch blocking each operator runs when it is called: 3 eager forward + backward passes of the 2-layer
  tiny model took 1.5 s and 2.9 CPU-s instead of 3.5 s and 7.0 CPU-s on a 2-core AVX2 EPYC, with the same loss;
  graph-mode training is unchanged (bench/pynative_launch.py). On Ascend and GPU asynchronous launches overlap host
  and device work, so it stays unset. MindSpore reads it once, when it is imported.
- `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`. MindSpore 2.9's generated protobuf modules (checkpoint_pb2, ...)
  load only with protobuf's pure-Python backend; `import mindspore` selects it, but only when protobuf is not loaded
  yet. tensorboardX and tensorboard load protobuf, so importing either before MindSpore made `import mindspore` fail
  ("Descriptors cannot be created directly"). Chosen before anything loads protobuf, any import order works.
- `GLOG_v=3`: MindSpore's C++ log at errors only (its warnings flood a notebook's output).
- `LOG_MF_PATH`: mindformers' file logs under runs/logs/mindformers instead of ./output of the working directory.
- `TQDM_MININTERVAL=5`: progress bars redraw every 5 s, not many times a second, in logs and notebook outputs.
- `USE_TORCH=0`, only when asked (`torch=False`): transformers then skips importing torch, ~6 s of the ~11 s a
  tokenising command took; a process that may need torch later must not set it.
"""
from __future__ import annotations

import os
import sys

from labkit.errors import LabkitError
from labkit.paths import RUNS

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
# read by MindSpore (or protobuf, which MindSpore loads) when `import mindspore` runs: too late once it has
READ_AT_IMPORT = ("MS_DEV_LAUNCH_BLOCKING", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "GLOG_v")

_late: list[str] = []  # settings this process made after MindSpore was already imported


def process_env(device_target: str = "CPU", *, torch: bool = True) -> dict[str, str]:
    """The settings a lab process on `device_target` runs with (the launcher puts them in its workers' env)."""
    if device_target not in DEVICE_TARGETS:
        raise LabkitError(f"device_target '{device_target}' is not one of {', '.join(DEVICE_TARGETS)}",
                          "set parallel.device_target (or the notebook's device_target) to CPU, GPU or Ascend")
    env = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "GLOG_v": "3",
           "LOG_MF_PATH": str(RUNS / "logs" / "mindformers"), "TQDM_MININTERVAL": "5"}
    if device_target == "CPU":
        env["MS_DEV_LAUNCH_BLOCKING"] = "1"
    if not torch:
        env["USE_TORCH"] = "0"
    return env


def prepare_process(device_target: str = "CPU", *, torch: bool = True) -> dict[str, str]:
    """Set this process's settings for `device_target` where the environment has none; returns what it set.

    Call it before anything imports MindSpore. Called after, the settings MindSpore reads at import are noted
    (`late_settings`), and `labkit doctor` reports them."""
    wanted = process_env(device_target, torch=torch)
    new = {k: v for k, v in wanted.items() if k not in os.environ}
    if "mindspore" in sys.modules:
        _late.extend(k for k in new if k in READ_AT_IMPORT and k not in _late)
    os.environ.update(new)
    return new


def before_protobuf() -> None:
    """Called where labkit itself loads protobuf (TensorBoard's writer and reader), which may be before MindSpore in
    a process no entry point prepared (a user's script): keeps a later `import mindspore` working."""
    if "google.protobuf" not in sys.modules:
        os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")


def late_settings() -> list[str]:
    """Settings this process made only after MindSpore was imported: MindSpore started without them."""
    return list(_late)


def import_order_warning() -> dict | None:
    """A doctor finding when this process imported MindSpore before `prepare_process` made settings it reads."""
    if not _late:
        return None
    return {"what": f"MindSpore was imported before labkit prepared this process: {', '.join(_late)} came too late "
                    "(MindSpore reads them when it is imported)",
            "fix": "call labkit.runtime.prepare_process(device_target) (a notebook: nb.setup(...)) before "
                   "`import mindspore`, or restart the kernel and run the cells in order"}
