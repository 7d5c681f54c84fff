"""Quiet by default: MindSpore's and mindformers' logs go to files under runs/, the console keeps errors."""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import io
import logging
import re
import sys
import types

# mindformers names its logger after its log folder ("mindformers/<checkout>/runs/logs/mindformers"), and its console
# format prints that name on every line; the console here says "mindformers" and the level (the files keep theirs).
CONSOLE_FORMAT = "%(asctime)s mindformers %(levelname)s [%(filename)s:%(lineno)d] %(message)s"
# Importing mindformers imports its PyNative DeepSeek-V3 and Qwen3 classes, which need the `hyper_parallel` package
# (not a dependency of mindformers, not on PyPI): each logs a WARNING on every import. The lab's model is the
# graph-mode Llama, which does not use them: these lines stay in mindformers' log files, not on the console.
IMPORT_NOISE = re.compile(r"Import PyNative\w+ failed: No module named 'hyper_parallel'")


def _console_handlers():
    for name, lg in list(logging.Logger.manager.loggerDict.items()):  # named "mindformers<log dir>"
        if name.startswith("mindformers") and isinstance(lg, logging.Logger):
            yield from (h for h in lg.handlers
                        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler))


def quiet_mindformers_console() -> None:
    """Keep mindformers' console handlers to errors, in a short format (its log files still get everything). Its
    loggers exist only after it is imported, and some of its modules add handlers when first imported: call again
    after those."""
    for h in _console_handlers():
        h.setLevel(logging.ERROR)
        h.setFormatter(logging.Formatter(CONSOLE_FORMAT))


# Imported by mindformers' package __init__ but never called by the lab: HF `datasets` (its HF dataloader) and
# `nltk` (its BLEU metric, which pulls in scipy.stats): ~1.5 s of CPU in every process that imports mindformers.
DEFERRED = ("datasets", "nltk")


class _StandIn(types.ModuleType):
    """A module of DEFERRED while mindformers imports: any name imported from it is a class that refuses to be
    instantiated, saying why."""

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []  # a package, so `from datasets.distributed import ...` resolves to another stand-in

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        qualname = f"{self.__name__}.{attr}"

        def refuse(cls, *args, **kwargs):
            raise RuntimeError(f"{qualname} was not imported: labkit defers {', '.join(DEFERRED)} while mindformers "
                               f"imports (labkit/logs.py); import it before labkit imports mindformers to use it")

        value = type(attr, (), {"__new__": refuse, "__module__": self.__name__})
        setattr(self, attr, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _unused_imports_deferred():
    """Importing mindformers imports PyTorch (~1.5 s per process) through tensorboardX, which tries `import torch`
    only to accept torch tensors in its writer; a MindSpore process never passes one. While mindformers imports,
    `import torch` fails at once (a None entry in sys.modules), and the modules in DEFERRED are stand-ins; afterwards
    all of them import as before. One lasting effect: mindformers' own references to them (its HF dataloader, its
    BLEU metric) stay stand-ins in such a process; the lab calls neither. A module already imported is left alone
    (mindformers gets the real one); nltk's scipy.stats, which asks at import whether torch is there, is then
    already imported too."""
    torch_absent = "torch" not in sys.modules
    absent = tuple(name for name in DEFERRED if name not in sys.modules)
    finder = _StandInFinder(absent) if absent else None
    if torch_absent:
        sys.modules["torch"] = None
    if finder is not None:
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
            for name in [n for n, m in sys.modules.items() if isinstance(m, _StandIn)]:
                del sys.modules[name]
        if torch_absent and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def quiet_mindformers() -> None:
    """Import mindformers with its console kept to errors (where its file logs go, and MindSpore's log level, are
    process settings: `labkit.runtime.prepare_process`, called first by every entry point).

    mindformers logs to stdout through handlers bound when it is first imported, so the import happens here, once,
    with stdout captured; its console handlers then write to stderr, where the captured lines go too, without the
    import warnings of IMPORT_NOISE."""
    if "mindformers" in sys.modules and getattr(quiet_mindformers, "done", False):
        return
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), _unused_imports_deferred():
        import mindformers  # noqa: F401
    for h in _console_handlers():
        if h.stream is captured:
            h.setStream(sys.stderr)
    sys.stderr.write("".join(line for line in captured.getvalue().splitlines(keepends=True)
                             if not IMPORT_NOISE.search(line)))
    quiet_mindformers_console()
    quiet_mindformers.done = True
