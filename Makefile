# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The versions the CUDA image installs (its build arguments and images/constraints.txt), so the
# tests run what the pods run; a new upstream release reaches both only through a commit.
image_arg = $(shell sed -n 's/^ARG $(1)=//p' images/Dockerfile)
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==$(call image_arg,TORCH_VERSION)
TRANSFORMERS ?= transformers==$(call image_arg,TRANSFORMERS_VERSION)

.PHONY: setup demo test clean

$(BIN)/dflashctl: pyproject.toml images/Dockerfile images/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -c images/constraints.txt "$(TRANSFORMERS)" -e ".[jobs,test]"
	touch $@

setup: $(BIN)/dflashctl

demo: setup
	$(BIN)/dflashctl demo

test: setup
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) demo .dflash
