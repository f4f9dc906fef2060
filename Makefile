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

.PHONY: setup e2e test test-unit test-integration clean-runs nightly

setup:
	@DEVICE=$(DEVICE) bash scripts/setup.sh

e2e: setup
	$(PY) -m harness e2e --tp-p $(TP_P) --tp-d $(TP_D) $(if $(MODEL),--model $(MODEL)) $(if $(DEVICE),--device $(DEVICE)) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(if $(VLLM_VERSION),--vllm-version $(VLLM_VERSION)) $(if $(filter 1 yes true,$(ACCURACY)),--accuracy) $(E2E_ARGS)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# The nightly GPU run (8 GPUs); DRY_RUN=1 prints every step, server command and GPU plan on any machine.
nightly: setup
	$(PY) -m harness nightly $(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(if $(VLLM_VERSION),--vllm-version $(VLLM_VERSION)) $(NIGHTLY_ARGS)

clean-runs:
	rm -rf runs
