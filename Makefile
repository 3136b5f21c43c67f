# The two commands a new user needs: `make train` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install train test test-all smoke lint format bench gpu-check figures clean

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

# Every feature, in at most 5 minutes on 2 cores; test-all adds the long matrices (tests marked slow: rollback at
# every step, fault x clip, the non-editable install, kill-anywhere, a resumed DDP run, the submitit sweep, a sweep
# with a failed job, the pretraining inside the clock), then the fresh-interpreter pass of make test's runs.
# Two test processes at once (pytest-xdist), each test file on one of them: ARGS="-n 0" runs them in this one.
test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile $(ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)
	@# the fresh-interpreter pass: every run make test forks from the pre-imported zygote, started as a user starts
	@# it (its own imports, warnings, environment and hash salt)
	WAPSTABLE_TEST_FRESH=1 $(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile $(ARGS)

# pip install . into a fresh venv of another Python (PYTHON=python3.12) and a debug=tiny run of the installed command.
smoke:
	scripts/install_smoke.sh $(PYTHON)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed
	$(PY) scripts/bench.py $(ARGS)

# The CUDA paths on one GPU in at most 5 minutes, one table, exit 1 on a failure; ARGS="--device cpu --quick" on a CPU.
gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py $(ARGS)

# The documentation's pictures into docs/; ARGS="--run RUN_DIR --checkpoint CKPT" adds the ExpRate curve and attention maps.
figures: $(VENV)/.installed
	$(PY) scripts/figures.py $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
