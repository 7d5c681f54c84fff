"""Suite-wide pytest settings: the order in which files start when `make test` runs them on several workers.

`make test` runs pytest-xdist with `--dist loadfile`: every file (a test module, or a notebook whose cells must run
in order in one kernel) goes to one worker as a whole. The longest files start first, so that the workers finish
together instead of one of them starting a four-minute notebook at the end (longest-first scheduling). The list is
measured (`--durations`), longest first; a file not in it keeps its place after these. The Makefile passes
`--no-loadscope-reorder`: without it pytest-xdist re-sorts the files by their number of test items, which put a
two-test file of three minutes (test_multinode.py) last, running alone while the other worker idled. Tests marked
`alone` (speed measurements) run afterwards in a second, single-process pytest (Makefile)."""
from __future__ import annotations

LONGEST_FIRST = (  # seconds per file on a worker, from `--durations=0` runs with 2 workers on 2026-12-02
    "notebooks/08_troubleshooting.ipynb",  # 250
    "notebooks/04_single_card.ipynb",  # 240
    "tests/test_multinode.py",  # 183
    "notebooks/05_data_parallel.ipynb",  # 172
    "tests/test_faults.py",  # 164
    "tests/test_bad_inputs.py",  # 135
    "tests/test_ui.py",  # 124
    "tests/test_eval.py",  # 108
    "notebooks/06_auto_parallel.ipynb",  # 94
    "notebooks/07_pretrain.ipynb",  # 72
    "tests/test_train.py",  # 51
    "notebooks/02_tokenizer_alignment.ipynb",  # 47
    "notebooks/03_data_pipeline.ipynb",  # 43
    "tests/test_kernels.py",  # 38
    "notebooks/00_environment.ipynb",  # 37
    "tests/test_plan.py",  # 35
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order inside a file, and of the files not listed, stays as collected
