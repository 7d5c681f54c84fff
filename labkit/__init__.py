"""labkit: the code behind the MindSpore LLM pretraining lab's notebooks and CLI."""
import os

from labkit.paths import accelerator_device_files

__version__ = "0.1.0"

# MindSpore runs PyNative (eager) operators through a pipeline of queue threads (frontend, backend, bprop) that spin
# while they wait; on a machine with few cores they take the cores the operators need. With launch blocking each
# operator runs when it is called: 3 eager forward + backward passes of the 2-layer tiny model took 1.5 s and 2.9
# CPU-s instead of 3.5 s and 7.0 CPU-s on a 2-core AVX2 EPYC, with the same loss; graph-mode training is unchanged
# (bench/pynative_launch.py). MindSpore reads the variable once, when it starts: it is set here, before the lab
# imports MindSpore, and child processes (training runs, msrun workers) inherit it. Only on a machine without
# Ascend or NVIDIA devices, where asynchronous launches overlap host and device work; a value already set wins.
if not accelerator_device_files():
    os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
