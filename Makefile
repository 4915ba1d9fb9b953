# `make run`: create .venv and run the quickstart on the embedded engines.
# `make test`: create .venv and run the quick tier (every test not marked slow, cluster or
#   multihost; under 10 minutes on 2 cores), what a contributor runs before a commit.
# `make test-all`: create .venv and run the whole suite in one pytest, the quick tier's tests
#   then the rest, each tier timed (tests/tiers.sh); what CI runs. It installs Chromium if missing (as root, apt-get).
#   PYTEST_ARGS go to pytest in both, e.g. make test PYTEST_ARGS=-x
# `make docs` / `make docs-serve`: build (strict) / serve the documentation site (mkdocs.yml).
# `make docs-ref`: regenerate docs/reference/ from the code (config models, CLI, bad-input catalog).
# `make typecheck`: pyright on the package ([tool.pyright] in pyproject.toml), as CI runs it.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
# mkdocs-material prints a banner about its successor on every build; not ours to act on.
export NO_MKDOCS_2_WARNING := 1

.PHONY: run test test-all venv docs docs-serve docs-ref typecheck clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test,docs,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardline run jobs/configs/quickstart.toml

# A test's tier is its marker (pyproject.toml); tests/tiers.sh holds the expression.
test: $(STAMP)
	PYTHON=$(VENV)/bin/python bash tests/tiers.sh quick $(PYTEST_ARGS)

test-all: $(STAMP)
	PYTHON=$(VENV)/bin/python bash tests/tiers.sh all $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

docs-ref: $(STAMP)
	$(VENV)/bin/python docs/gen_ref.py

typecheck: $(STAMP)
	$(VENV)/bin/pyright

clean:
	rm -rf shardline-data mlruns mlflow.db .pytest_cache site
