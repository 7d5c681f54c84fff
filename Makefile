# `make run` and `make test` create .venv on first use and reuse it afterwards
# (it is rebuilt only when pyproject.toml changes).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
export PATH := $(abspath $(BIN)):$(PATH)
export GLOG_v ?= 3
export TQDM_MININTERVAL ?= 5
# pytest workers for `make test`: 2 suits 2 cores (each worker trains MindSpore models with ~2 GB of memory)
TEST_WORKERS ?= 2

.PHONY: run test lab venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: '$(PYTHON)' was not found (set PYTHON=/path/to/python3.11)"; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "$(PYTHON) is not Python 3.11"; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e '.[lab,test]'
	@# pip byte-compiles what it installs on one core (~70 s); compileall uses every core (~35 s on 2). Needed: with
	@# PYTHONDONTWRITEBYTECODE set, a module left uncompiled is compiled again at every import. Like pip, it skips
	@# files that do not compile (packages ship Python 2 fixtures), so its messages and exit status are ignored.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	$(BIN)/python -m pip check
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/labkit run $(ARGS)

test: $(STAMP)
	LABKIT_STRICT_EXERCISES=1 $(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" --durations=30 tests notebooks --nbval-lax --nbval-current-env $(ARGS)
	LABKIT_STRICT_EXERCISES=1 $(BIN)/python -m pytest -p no:cacheprovider -m alone --durations=10 tests $(ARGS) || test $$? -eq 5  # 5: ARGS selected none of them

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf runs notebooks/output output
