# The two set-up commands of the README (`make demo`, `make test`) and the GPU check (`make gpu-test`).
#
# Installs are conditional so that a GPU machine with torch preinstalled and no network downloads
# nothing: torch is installed only when it cannot be imported (then `torch==2.13.0`, the CPU build
# on CI machines); rich, pytest and numpy (tests call Tensor.numpy) only when missing; torchreplay
# itself without network (`--no-deps --no-build-isolation`). If that editable install fails,
# everything still runs from this checkout: every command below puts the repository on PYTHONPATH.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
RUN := PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON)

.PHONY: install test demo gpu-test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	@$(PYTHON) -c "import rich" 2>/dev/null || $(PIP) install "rich>=13"
	@$(PYTHON) -c "import pytest" 2>/dev/null || $(PIP) install pytest
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PIP) install numpy
	@$(PIP) install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
		|| echo "note: editable install of torchreplay failed; running from this checkout (PYTHONPATH=.)"

test: install
	$(RUN) -m pytest tests -q

# `python -m torchreplay` is the `torchreplay` command; it does not depend on the scripts
# directory being on PATH.
demo: install
	$(RUN) -m torchreplay bench

gpu-test:
	$(RUN) scripts/gpu_test.py
