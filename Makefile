# Two targets a new user needs; each sets up .venv on first use.
#   make demo   the offline demo (recipes/compare.py): baseline vs QANA fine-tuning, offline, CPU, ~3 min
#   make test   run the test suite (offline)
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: demo test install

install: $(VENV)/.installed

# torch is installed first and pinned: a bare `pip install torch` may resolve to a build with several GB of
# CUDA packages where a CPU build is what this machine has.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[dev,recipes,peft]"
	touch $@

demo: install
	$(BIN)/accelerate launch -m recipes.compare

test: install
	$(BIN)/python -m pytest -q
