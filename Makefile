# The two commands a new user needs: `make train` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install train test lint format bench figures clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@# an environment from before the sweeper moved into this repo: its plugin would clash with ours
	$(PY) -m pip uninstall --quiet --yes hydra-optuna-sweeper 2>/dev/null || true
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed
	$(PY) scripts/bench.py $(ARGS)

# The README's pictures into docs/; ARGS="--run RUN_DIR --checkpoint CKPT" adds the ExpRate curve and attention maps.
figures: $(VENV)/.installed
	$(PY) scripts/figures.py $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
