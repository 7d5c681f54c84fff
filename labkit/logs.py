"""Quiet by default: MindSpore's and mindformers' logs go to files under runs/, the console keeps errors."""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from labkit.paths import RUNS


def quiet_mindformers_console() -> None:
    """Keep mindformers' console handlers to errors (its log files still get everything). Its loggers exist only
    after it is imported, and some of its modules add handlers when first imported: call again after those."""
    for name, lg in list(logging.Logger.manager.loggerDict.items()):  # named "mindformers<log dir>"
        if name.startswith("mindformers") and isinstance(lg, logging.Logger):
            for h in lg.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    h.setLevel(logging.ERROR)


@contextlib.contextmanager
def _torch_not_imported():
    """Importing mindformers imports PyTorch (~1.5 s per process) through tensorboardX, which tries `import torch`
    only to accept torch tensors in its writer; a MindSpore process never passes one. While mindformers imports,
    `import torch` fails at once (a None entry in sys.modules), and afterwards it works as before. scipy.stats is
    imported first: nltk imports it inside the window, and its import-time docs ask whether arrays are torch's.
    One lasting effect: `datasets` (imported by mindformers) records torch as unavailable, so its torch output
    format is off in such a process; the lab never asks datasets for torch tensors."""
    if "torch" in sys.modules:  # already there (a notebook that converted weights): nothing to save
        yield
        return
    import scipy.stats  # noqa: F401

    sys.modules["torch"] = None
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def quiet_mindformers(log_dir: str | os.PathLike | None = None) -> None:
    """Send mindformers' file logs under runs/ instead of ./output and keep its console to errors.

    mindformers logs INFO lines to stdout through handlers bound when it is first imported, so the import happens
    here, once, with stdout pointed at stderr."""
    os.environ.setdefault("GLOG_v", "3")
    os.environ.setdefault("LOG_MF_PATH", str(log_dir or RUNS / "logs" / "mindformers"))
    if "mindformers" in sys.modules and getattr(quiet_mindformers, "done", False):
        return
    with contextlib.redirect_stdout(sys.stderr), _torch_not_imported():
        import mindformers  # noqa: F401
    quiet_mindformers_console()
    quiet_mindformers.done = True
