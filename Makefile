# `make run`: create .venv and run the quickstart on the embedded engines.
# `make test`: create .venv and run the whole test suite.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardline run jobs/configs/quickstart.toml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -x

clean:
	rm -rf shardline-data mlruns mlflow.db .pytest_cache
