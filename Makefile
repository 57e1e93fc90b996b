# Convenience wrapper around CMake. `make demo` and `make test` are the two commands in the README.
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The tests' Python references run in the venv scripts/install-deps.sh makes.
ifneq ($(wildcard .venv/bin/python),)
CMAKE_FLAGS += -DPython3_EXECUTABLE=$(CURDIR)/.venv/bin/python
endif

.PHONY: all build demo test test-sanitize fuzz valgrind clean format

all: build

build:
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/megamoe demo

# ctest's summary says "Skipped" without why: the skipped tests' own reasons are printed after it.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS); rc=$$?; $(CURDIR)/tests/skip_reasons.sh .; exit $$rc

# The CPU suite under AddressSanitizer and UndefinedBehaviorSanitizer. It leaves out, and says so:
# test_gpu (not built: no CUDA in this build, ASan and the CUDA runtime do not mix; compute-sanitizer
# checks the GPU side) and the tests labelled nosan (py_formats: ctypes cannot load an ASan-built
# library into an uninstrumented python); `make test` runs both.
test-sanitize:
	cmake -S . -B $(ASAN_BUILD) -DMEGAMOE_SANITIZE=ON -DMEGAMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug $(CMAKE_FLAGS) >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	@echo "test-sanitize: not run here: test_gpu (no CUDA in a sanitizer build; compute-sanitizer covers the GPU)" \
	  "and, labelled nosan, $$(cd $(ASAN_BUILD) && ctest -N -L nosan | sed -n 's/^ *Test *#[0-9]*: //p' | paste -sd, -)" \
	  "(ctypes cannot load an ASan-built library into python); make test runs them"
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS) -LE nosan; rc=$$?; $(CURDIR)/tests/skip_reasons.sh .; exit $$rc

# Runs each fuzz target (safetensors, loader, forward) for FUZZ_SECONDS over its tracked seeds; what it
# finds goes to build-fuzz/corpus/ (ignored), so the tree stays clean (clang + libFuzzer).
FUZZ_SECONDS ?= 60
fuzz:
	./tests/fuzz/run.sh $(FUZZ_SECONDS)

# The CLI's inspect, run and quantize under valgrind's memcheck (a CPU build of its own): 0 errors.
VALGRIND_BUILD ?= build-valgrind
valgrind:
	cmake -S . -B $(VALGRIND_BUILD) -DMEGAMOE_CUDA=OFF $(CMAKE_FLAGS) >/dev/null
	cmake --build $(VALGRIND_BUILD) -j $(JOBS) --target megamoe_cli
	./tests/valgrind/run.sh $(VALGRIND_BUILD)/megamoe

format:
	clang-format -i include/*.h src/*.c src/*.h src/*/*.c src/cuda/*.h src/cuda/*.cu src/cuda/*.cuh \
	  src/cuda/*/*.cuh src/ep/*.cu tools/*.c tests/*.c tests/*.h

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(VALGRIND_BUILD) build-fuzz
