# Everything creates or reuses the local virtualenv .venv on its own.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The editable install maps each Python module to its file when it is installed: a module added,
# moved or removed needs a reinstall, so the stamp is named after the set of module paths.
MODULES_HASH := $(shell find src/gml -name '*.py' | LC_ALL=C sort | cksum | cut -d' ' -f1)
STAMP  := $(VENV)/.gml-installed-$(MODULES_HASH)
BENCH_STAMP := $(VENV)/.gml-bench-installed

.PHONY: demo test test-tiers lint fuzz bench install install-bench clean sanitize

$(STAMP): pyproject.toml $(wildcard native/*.cpp native/*.h native/*.inc native/CMakeLists.txt)
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
# Then the INT8 tests again under each lower ISA tier this CPU can run (ONEDNN_MAX_CPU_ISA=AVX2: no
# AVX-512, no VNNI; AVX512_CORE: AVX-512 without VNNI), as `python -m gml.runtime.target` lists
# them (docs/adr/011-int8-on-every-isa.md): the correctness of INT8 on every tier from one machine.
INT8_TIER_TESTS = tests/ir/test_target.py tests/kernels/test_onednn_int8.py tests/kernels/test_float_int8.py tests/quant/test_int8_isa.py \
	tests/runtime/test_dynamic_linear.py tests/runtime/test_dynamic_linear_residual.py tests/runtime/test_exact_qlinear.py tests/runtime/test_ops.py \
	tests/runtime/test_reference_kernels.py tests/runtime/test_winograd_int8.py tests/runtime/test_im2col_int8.py tests/runtime/test_dw_int8.py \
	tests/runtime/test_conv_pad.py tests/test_reliability.py tests/test_reliability24.py tests/fuzz/test_regressions.py \
	tests/fuzz/test_fuzz_int8.py
test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-tiers

test-tiers: $(STAMP)
	@tiers="$$($(BIN)/python -m gml.runtime.target | tail -n 1)"; \
	for cap in $$tiers; do \
		echo "== INT8 tests under ONEDNN_MAX_CPU_ISA=$$cap"; \
		ONEDNN_MAX_CPU_ISA=$$cap $(BIN)/python -m pytest -q -p no:cacheprovider $(INT8_TIER_TESTS) || exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# The properties run as two processes, one per core (~1 h instead of 2 on 2 cores); each writes its
# log under build/ and both are printed at the end.
FUZZ_A = tests/fuzz/test_fuzz_bf16.py tests/fuzz/test_fuzz_fp32.py tests/fuzz/test_fuzz_transformer.py
FUZZ_B = $(filter-out $(FUZZ_A),$(wildcard tests/fuzz/test_*.py))
fuzz: $(STAMP)
	@mkdir -p build; \
	GML_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q -p no:cacheprovider $(FUZZ_A) > build/fuzz-a.log 2>&1 & a=$$!; \
	GML_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q -p no:cacheprovider $(FUZZ_B) > build/fuzz-b.log 2>&1; b=$$?; \
	wait $$a; a=$$?; cat build/fuzz-a.log build/fuzz-b.log; \
	test $$a -eq 0 && test $$b -eq 0

# The native engine built with AddressSanitizer + UndefinedBehaviorSanitizer (build/sanitize/), then
# the engine tests and a few whole models (ResNet18 INT8, ResNet18/50 and MobileNetV2 fp32, HF Dinov2,
# the issue #24 regressions) run against it (GML_ENGINE_LIBRARY); any report fails the run.
# ASan does not see writes by oneDNN's JIT kernels (not instrumented): the plan checks every value it
# places in a caller's tensor against that tensor's size (Plan.external_bytes) for that class.
SAN_TESTS = tests/runtime tests/passes/test_whole_models.py tests/test_reliability24.py tests/kernels/test_woq_native.py tests/kernels/test_woq_pool.py tests/llm/test_llm_store.py tests/llm/test_llm_decode.py
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
	$(BIN)/python -m pytest -q -p no:cacheprovider $(SAN_TESTS)

bench: $(BENCH_STAMP)
	$(BIN)/gml bench resnet18 --batch-sizes 1,8 --md docs/benchmarks-latest.md --png docs/benchmarks-latest.png --json docs/benchmarks-latest.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
