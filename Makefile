# Set-up and checks for a fresh machine that has only Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint bench clean

# torch goes first and alone: its CPU wheel lies on local disk, while an open range pulled in
# by another package would download a multi-GB CUDA build.
$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/mint demo

test: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest

clean:
	rm -rf $(VENV) .mint .pytest_cache .ruff_cache
