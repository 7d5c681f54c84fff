"""Notebook 07's logic: one parameterised pretraining run, from the tiny CPU smoke run to Llama-2-7B on 8 cards.

    params        the parameters (one glossary with the config fields), presets, precision per AMP level
    planner_view  the planner's estimate for one layout, the batch arithmetic per dp, the devices this machine has
    runspec       the notebook's parameters -> a validated PretrainRun (layout, batch, memory, devices, files)
    outputs       run.yaml, mindformers.yaml, plan.json and launch.sh (the command per node), written once by
                  node 0; node0_only(run, what) says what another node skips and why
    follow        `labkit launch` with a live view of metrics.jsonl
    results       final figures, shape proofs without weights, the two 7B recipes compared, the 7B at 32k
                  tokens without and with context parallelism

The notebook imports this package; the names below are its whole interface."""
from labkit.course.pretrain.params import Param, PARAMETERS, PARAMS, DEFAULTS, PRESETS, DEVICE_FOR_TARGET, SEED_AS_WRITTEN  # noqa: F401
from labkit.course.pretrain.planner_view import estimate  # noqa: F401
from labkit.course.pretrain.runspec import PretrainRun, host_ram_gib, getattr_dotted, resolve  # noqa: F401
from labkit.course.pretrain.outputs import (layout_table, mindformers_yaml, commands, write_configs,  # noqa: F401
                                            config_texts, NODE0_ONLY, node0_only)
from labkit.course.pretrain.follow import PANELS, figure_png, status_line, Follower, launch  # noqa: F401
from labkit.course.pretrain.results import expected_shapes, prove_shapes, checkpoint_shapes, summarize, recipe_row, compare_recipes, long_context_rows  # noqa: F401
