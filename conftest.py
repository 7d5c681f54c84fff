"""Suite-wide pytest settings: the order in which files start when `make test` runs them on several workers.

`make test` runs pytest-xdist with `--dist loadfile`: every file (a test module, or a notebook whose cells must run
in order in one kernel) goes to one worker as a whole. The longest files start first, so that the workers finish
together instead of one of them starting a four-minute notebook at the end (longest-first scheduling). The list is
measured (`--durations`), longest first; a file not in it keeps its place after these. Tests marked `alone`
(speed measurements) run afterwards in a second, single-process pytest (Makefile)."""
from __future__ import annotations

LONGEST_FIRST = (
    "notebooks/04_single_card.ipynb",
    "notebooks/08_troubleshooting.ipynb",
    "notebooks/05_data_parallel.ipynb",
    "tests/test_multinode.py",
    "tests/test_bad_inputs.py",
    "tests/test_faults.py",
    "tests/test_ui.py",
    "tests/test_eval.py",
    "notebooks/07_pretrain.ipynb",
    "tests/test_train.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order inside a file, and of the files not listed, stays as collected
