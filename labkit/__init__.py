"""labkit: the code behind the MindSpore LLM pretraining lab's notebooks and CLI."""
import os

from labkit.paths import accelerator_device_files

__version__ = "0.1.0"

# MindSpore runs PyNative (eager) operators through a pipeline of queue threads (frontend, backend, bprop) that spin
# while they wait; on a machine with few cores they take the cores the operators need. With launch blocking each
# operator runs when it is called: 3 eager forward + backward passes of the tiny model took 2.5 s and 4.9 CPU-s
# instead of 6.4 s and 12.7 CPU-s on 2 cores, with the same loss; graph-mode training is unchanged
# (bench/pynative_launch.py). MindSpore reads the variable once, when it starts: it is set here, before the lab
# imports MindSpore, and child processes (training runs, msrun workers) inherit it. Only on a machine without
# Ascend or NVIDIA devices, where asynchronous launches overlap host and device work; a value already set wins.
if not accelerator_device_files():
    os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
