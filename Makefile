# The two commands: `make e2e` and `make test`. Both set up .venv first.
PY := .venv/bin/python
TP_P ?= $(or $(PREFILLER_TP_SIZE),1)
TP_D ?= $(or $(DECODER_TP_SIZE),1)
MODEL ?=
DEVICE ?=
RUN_DIR ?=
VLLM_VERSION ?=
ACCURACY ?=
E2E_ARGS ?=
PYTEST_ARGS ?=
DRY_RUN ?=
NIGHTLY_ARGS ?=
# An offline install's folder of wheels: `make wheelhouse` writes it, `make setup WHEELHOUSE=DIR` installs from it.
WHEELHOUSE ?=
WHEELHOUSE_ARGS ?=

.PHONY: setup e2e test test-full test-unit test-integration clean-runs nightly wheelhouse lint

setup:
	@DEVICE=$(DEVICE) WHEELHOUSE=$(WHEELHOUSE) bash scripts/setup.sh

# On a connected machine (docs/offline-install.md), e.g. for a GPU image with torch 2.11.0+cu130:
#   make wheelhouse WHEELHOUSE=/data/wh WHEELHOUSE_ARGS="--torch 2.11.0+cu130 --python 3.12 --platform manylinux_2_31_x86_64 --drop-kernels fa2"
# DEVICE=cpu: a CPU machine like this one. This machine's own .venv is set up first, from the index.
wheelhouse:
	$(if $(WHEELHOUSE),,$(error give WHEELHOUSE=DIR, the folder to write))
	@DEVICE= WHEELHOUSE= bash scripts/setup.sh
	$(PY) -m harness wheelhouse --out $(WHEELHOUSE) $(if $(DEVICE),--device $(DEVICE)) $(WHEELHOUSE_ARGS)

e2e: setup
	$(PY) -m harness e2e --tp-p $(TP_P) --tp-d $(TP_D) $(if $(MODEL),--model $(MODEL)) $(if $(DEVICE),--device $(DEVICE)) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(if $(VLLM_VERSION),--vllm-version $(VLLM_VERSION)) $(if $(filter 1 yes true,$(ACCURACY)),--accuracy) $(E2E_ARGS)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

# ruff (its rules and the format check) and mypy over harness/, tests/ and toy_proxy_server.py (mypy's files are in
# pyproject.toml); CI runs it before the tests and fails on a finding; .pre-commit-config.yaml runs the same commands.
# The tools go into .venv once per requirements/lint.txt (a stamp beside setup's).
lint: setup
	@stamp="$$(sha256sum requirements/lint.txt | cut -d' ' -f1)"; \
	  [ "$$(cat .venv/.lint-stamp 2>/dev/null)" = "$$stamp" ] || \
	  { $(PY) -m pip install -q --disable-pip-version-check -r requirements/lint.txt && echo "$$stamp" > .venv/.lint-stamp; }
	$(PY) -m ruff check harness tests toy_proxy_server.py
	$(PY) -m ruff format --check harness tests toy_proxy_server.py
	$(PY) -m mypy

# Everything, the tests beyond CI's representative cut included (marked `full`: whole matrices, installs, faults).
test-full: setup
	PD_HARNESS_FULL=1 $(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# The nightly GPU run (8 GPUs); DRY_RUN=1 prints every step, server command and GPU plan on any machine.
nightly: setup
	$(PY) -m harness nightly $(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(if $(VLLM_VERSION),--vllm-version $(VLLM_VERSION)) $(NIGHTLY_ARGS)

clean-runs:
	rm -rf runs
