"""Suite-wide pytest settings: the order in which files start when `make test` runs them on several workers.

`make test` runs pytest-xdist with `--dist loadfile`: every file (a test module, or a notebook whose cells must run
in order in one kernel) goes to one worker as a whole. The longest files start first, so that the workers finish
together instead of one of them starting a four-minute notebook at the end (longest-first scheduling). The list is
measured (`--durations`), longest first; a file not in it keeps its place after these. The Makefile passes
`--no-loadscope-reorder`: without it pytest-xdist re-sorts the files by their number of test items, which put a
two-test file of three minutes (test_multinode.py) last, running alone while the other worker idled. Tests marked
`alone` (speed measurements) run afterwards in a second, single-process pytest (Makefile)."""
from __future__ import annotations

import pytest

from labkit.runtime import prepare_process

prepare_process("CPU")  # the suite runs on CPU; before any test module imports MindSpore (labkit/runtime.py)


@pytest.fixture(scope="module")
def ms():
    """MindSpore in PyNative mode, for the tests that run the hand-written parallel code in this process."""
    import mindspore

    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    return mindspore

LONGEST_FIRST = (  # seconds per file on a worker, from a `--durations=0` fresh-clone run with 2 workers, 2026-12-02
    "notebooks/08a_memory_numerics.ipynb",  # 392 under nbval --durations at load average ~9 (08 whole was 223)
    "notebooks/04a_single_card.ipynb",  # 254 (alone under nbval, 2026-12-05, a busy machine; 04 was 252 before its split)
    "notebooks/04b_precision_and_knobs.ipynb",  # 202 (as 04a)
    "notebooks/05_data_parallel.ipynb",  # 197, measured before its drill runs stopped evaluating
    # after 05, not among the first three: its first test bounds node 0's whole run (start-up included) at 60 s, and
    # at the start every worker and kernel imports MindSpore at once (3 workers: 39-52 s there, 21 s with 2)
    "tests/test_multinode.py",  # 198
    "tests/test_faults.py",  # 176
    "tests/test_layouts.py",  # ~130: two msrun launches (2 and 4 workers) running every parallel layout
    "tests/test_ui.py",  # 121
    "tests/test_bad_inputs.py",  # 100
    "notebooks/06c_planner.ipynb",  # ~90: measuring the calibration is 72 of it (alone, 2026-12-05); 17 when cached
    "notebooks/08b_data_speed_debugging.ipynb",  # 47 under nbval --durations at load average ~9
    "tests/test_eval.py",  # 67
    "notebooks/06a_tensor_parallel.ipynb",  # ~20 after test_layouts (listed earlier) launched the parallel runs
    "notebooks/06b_pipeline_zero.ipynb",  # 11 under nbval (alone, 2026-12-05) after the parallel runs were cached
    "notebooks/07_pretrain.ipynb",  # 60
    "notebooks/02_tokenizer_alignment.ipynb",  # 50
    "tests/test_train.py",  # 48
    "notebooks/00_environment.ipynb",  # 40
    "notebooks/03_data_pipeline.ipynb",  # 40
    "tests/test_kernels.py",  # 38
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order inside a file, and of the files not listed, stays as collected
