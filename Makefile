# `make run`: create .venv and run the quickstart on the embedded engines.
# `make test`: create .venv and run the whole test suite.
# `make docs` / `make docs-serve`: build (strict) / serve the documentation site (mkdocs.yml).
# `make docs-ref`: regenerate docs/reference/ from the code (config models, CLI, bad-input catalog).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
# mkdocs-material prints a banner about its successor on every build; not ours to act on.
export NO_MKDOCS_2_WARNING := 1

.PHONY: run test venv docs docs-serve docs-ref clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test,docs,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardline run jobs/configs/quickstart.toml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -x

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

docs-ref: $(STAMP)
	$(VENV)/bin/python docs/gen_ref.py

clean:
	rm -rf shardline-data mlruns mlflow.db .pytest_cache site
