# Tandem: the one entry point. `make run` and `make test` do the setup they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROTOS := $(wildcard protos/tandem/v1/*.proto)
STUBS_STAMP := tandem/v1/.generated
DESCRIPTOR := build/tandem_descriptor.pb
CONFIG ?= configs/default.yaml

.PHONY: setup protos run test test-e2e lint bench clean

setup: $(VENV)/.installed $(STUBS_STAMP)

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
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

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m bench.overhead

clean:
	rm -rf $(VENV) build tandem/v1/*_pb2*.py* $(STUBS_STAMP)
