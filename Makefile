# Everything creates or reuses the local virtualenv .venv on its own.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gml-installed
BENCH_STAMP := $(VENV)/.gml-bench-installed

.PHONY: demo test lint fuzz bench install install-bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(BENCH_STAMP)

install: $(STAMP)

install-bench: $(BENCH_STAMP)

demo: $(STAMP)
	$(BIN)/gml demo

# The fuzz properties run their seeded CI budget (200 fp32 graphs, fewer INT8); `make fuzz` runs 10,000.
test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

fuzz: $(STAMP)
	GML_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q tests/fuzz

bench: $(BENCH_STAMP)
	$(BIN)/gml bench resnet18 --batch-sizes 1,8 --md docs/benchmarks-latest.md --png docs/benchmarks-latest.png --json docs/benchmarks-latest.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
