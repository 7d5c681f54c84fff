"""labkit: the code behind the MindSpore LLM pretraining lab's notebooks and CLI.

Importing labkit, or any of its modules, changes nothing in the process: what a process must set before MindSpore
starts is set by `labkit.runtime.prepare_process`, which the entry points call."""

__version__ = "0.1.0"
