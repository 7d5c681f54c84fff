# `make run` and `make test` create .venv on first use and reuse it afterwards
# (it is rebuilt only when pyproject.toml changes).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
export PATH := $(abspath $(BIN)):$(PATH)
export GLOG_v ?= 3
export TQDM_MININTERVAL ?= 5
# Python caches each module's bytecode when it first imports it (its default), here even where the environment sets
# PYTHONDONTWRITEBYTECODE: without a cache every process compiles MindSpore, torch and transformers again (~14 s
# more per process). The install imports what the lab uses, in two processes (~20 s on 2 cores), so that the test
# processes starting together do not all compile the same modules; the ~5,400 modules it caches are what a training
# run and `labkit doctor` import, of ~18,600 installed (compileall of everything took 38 s on 2 cores).
export PYTHONDONTWRITEBYTECODE :=
WARM_ML := from labkit.logs import quiet_mindformers; quiet_mindformers(); import mindspore.dataset, mindformers.models.llama, torch, transformers, safetensors.torch; from transformers import LlamaForCausalLM
WARM_NB := import matplotlib.pyplot, pandas, papermill, nbclient, ipykernel.kernelapp, ipywidgets, jupyter_server.serverapp, nbval, playwright.sync_api
# The install: uv unpacks the wheels in parallel (19 s here where pip took 55 s, the same pins; pip remains the
# fallback). uv does not read pip's configuration, so pip's sources go with it: find-links and indexes from the
# PIP_* variables and pip.conf, where a machine keeps its CPU build of torch or a mirror; and like pip, uv takes the
# best match from all of them (uv's default stops at the first index that has the package at all).
UV := uv==0.13.9
pip_conf = $(strip $($(1)) $(shell $(PYTHON) -m pip config get global.$(2) 2>/dev/null))
PIP_SOURCES = $(foreach s,$(sort $(call pip_conf,PIP_FIND_LINKS,find-links)),--find-links $(s)) \
  $(foreach s,$(firstword $(call pip_conf,PIP_INDEX_URL,index-url)),--index-url $(s)) \
  $(foreach s,$(call pip_conf,PIP_EXTRA_INDEX_URL,extra-index-url),--extra-index-url $(s))
# pytest workers for `make test`: 3 on 2 cores. A worker spends ~1/5 of its time waiting on processes it started
# (msrun start-up, heartbeat time-outs, the browser); a third fills those waits. Parallel phase on one 2-core machine:
# 844 s with 2 workers, 757 s with 3 (~15 s of it from two trimmed tests); with 4, 916 s and ~1,700 CPU-s against
# ~1,400 (the cores were already busy; more processes only contend). Each worker needs ~2-3 GB of memory.
TEST_WORKERS ?= 3

.PHONY: run test check lab venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: '$(PYTHON)' was not found (set PYTHON=/path/to/python3.11)"; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "$(PYTHON) is not Python 3.11"; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(UV)
	$(BIN)/uv pip install --quiet --python $(BIN)/python --index-strategy unsafe-best-match $(PIP_SOURCES) -e '.[lab,test]' \
	  || $(BIN)/python -m pip install --quiet --no-compile -e '.[lab,test]'
	$(BIN)/python -c '$(WARM_NB)' & nb=$$!; $(BIN)/python -c '$(WARM_ML)' && wait $$nb
	$(BIN)/python -m pip check
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/labkit run $(ARGS)

test: $(STAMP)
	LABKIT_STRICT_EXERCISES=1 $(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" --durations=30 tests notebooks --nbval-lax --nbval-current-env $(ARGS)
	LABKIT_STRICT_EXERCISES=1 $(BIN)/python -m pytest -p no:cacheprovider -m alone --durations=10 tests $(ARGS) || test $$? -eq 5  # 5: ARGS selected none of them

# The fast lane while editing: the unit tests that start no msrun, notebook, browser, training run or MindSpore
# process (not `slow`) and measure no speed (not `alone`). `make test` stays the full suite and CI's command.
check: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 -m "not slow and not alone" -q tests $(ARGS)

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf runs notebooks/output output
