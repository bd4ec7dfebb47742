# Everything creates or reuses the local virtualenv .venv on its own.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gml-installed
BENCH_STAMP := $(VENV)/.gml-bench-installed

.PHONY: demo test lint fuzz bench install install-bench clean sanitize

$(STAMP): pyproject.toml $(wildcard native/*.cpp native/*.h native/CMakeLists.txt)
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

# The native engine built with AddressSanitizer + UndefinedBehaviorSanitizer (build/sanitize/), then
# the engine tests run against it (GML_ENGINE_LIBRARY); any report fails the run.
SAN_LIBS = $$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)
sanitize: $(STAMP)
	$(BIN)/python -m pip install -q nanobind cmake ninja onednn-devel-cpu-gomp==2023.2.0
	$(BIN)/cmake -S native -B build/sanitize -G Ninja -DGML_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCMAKE_MAKE_PROGRAM=$(abspath $(BIN)/ninja) -DPython_EXECUTABLE=$(abspath $(BIN)/python)
	$(BIN)/cmake --build build/sanitize
	export GML_ENGINE_LIBRARY=$$(ls $(CURDIR)/build/sanitize/_engine*.so) LD_PRELOAD="$(SAN_LIBS)" \
		ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0:halt_on_error=1 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 && \
	$(BIN)/python -c "from gml.runtime import native; print('sanitized engine:', native.load().__file__)" && \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/runtime tests/kernels/test_woq_native.py

bench: $(BENCH_STAMP)
	$(BIN)/gml bench resnet18 --batch-sizes 1,8 --md docs/benchmarks-latest.md --png docs/benchmarks-latest.png --json docs/benchmarks-latest.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
