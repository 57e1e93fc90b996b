# Convenience wrapper around CMake. `make demo` and `make test` are the two commands in the README.
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The tests' Python references run in the venv scripts/install-deps.sh makes.
ifneq ($(wildcard .venv/bin/python),)
CMAKE_FLAGS += -DPython3_EXECUTABLE=$(CURDIR)/.venv/bin/python
endif

.PHONY: all build demo test test-sanitize fuzz clean format

all: build

build:
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/megamoe demo

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU suite under AddressSanitizer and UndefinedBehaviorSanitizer.
test-sanitize:
	cmake -S . -B $(ASAN_BUILD) -DMEGAMOE_SANITIZE=ON -DMEGAMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug $(CMAKE_FLAGS) >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS) -LE nosan

# Runs each fuzz target (safetensors, loader, forward) for FUZZ_SECONDS over its tracked seeds; what it
# finds goes to build-fuzz/corpus/ (ignored), so the tree stays clean (clang + libFuzzer).
FUZZ_SECONDS ?= 60
fuzz:
	./tests/fuzz/run.sh $(FUZZ_SECONDS)

format:
	clang-format -i include/*.h src/*.c src/*.h src/*/*.c tools/*.c tests/*.c tests/*.h

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-fuzz
