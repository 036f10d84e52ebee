# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test clean

$(BIN)/dflashctl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[jobs,test]"
	touch $@

setup: $(BIN)/dflashctl

demo: setup
	$(BIN)/dflashctl demo

test: setup
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) demo .dflash
