# Kernels to Clusters — a thin wrapper over CMake. Every target brings its own set-up, so on a
# fresh machine `make grade IMPL=solutions` and `make test` each work as the first command.
#
#   make deps                       install the Debian packages this machine lacks (as root),
#                                   or print the exact command to run
#   make build   [IMPL=...]         configure and build build/<IMPL> (assignments by default)
#   make test                       the project's own test suite (CPU; GPU tests skip without a GPU)
#   make grade   [IMPL=...] [MODULES=00,01] [SEED=n] [ARGS="--json r.json ..."]
#   make bench   [IMPL=...]         every module's benchmark sweep and the SGEMM ladder plot (GPU)
#   make tune    [IMPL=...]         choose module 04's tile configuration for this GPU
#   make handout OUT=dir            a student tree without solutions/
#   make clean
IMPL    ?= assignments
MODULES ?=
SEED    ?=
ARGS    ?=
BUILD   := build/$(IMPL)
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)

DEB_PACKAGES := cmake g++ ninja-build libgtest-dev libbenchmark-dev libcli11-dev \
                nlohmann-json3-dev libopenmpi-dev openmpi-bin python3-matplotlib

.PHONY: deps configure build test grade bench tune handout clean

deps:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps: all present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "deps: installing$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "deps: missing$$missing"; \
	  echo "      run: sudo apt-get update && sudo apt-get install -y$$missing"; \
	  command -v dpkg-query >/dev/null || echo "      (not a Debian system: install CMake >= 3.25, GoogleTest, Google Benchmark, CLI11, nlohmann/json, Open MPI)"; \
	fi

configure: deps
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(GENERATOR) -DK2C_IMPL=$(IMPL)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The suite runs against the reference solutions: their module tests must pass wherever a GPU
# is present, and skip (reported as skipped) where none is.
test: deps
	@test -f build/solutions/CMakeCache.txt || cmake -S . -B build/solutions $(GENERATOR) -DK2C_IMPL=solutions
	cmake --build build/solutions -j $(JOBS)
	ctest --test-dir build/solutions --output-on-failure -j $(JOBS)

grade: configure
	cmake --build $(BUILD) --target k2c -j $(JOBS)
	$(BUILD)/bin/k2c grade --impl $(IMPL) --build-dir $(BUILD) \
	  $(if $(MODULES),--modules $(MODULES)) $(if $(SEED),--seed $(SEED)) $(ARGS)

bench: build
	$(BUILD)/bin/k2c bench --build-dir $(BUILD)
	@py=python3; $$py -c "import matplotlib" 2>/dev/null || { test -x /usr/bin/python3 && py=/usr/bin/python3; }; \
	$$py tools/plot_ladder.py $(BUILD)/bench --png $(BUILD)/bench/sgemm_ladder.png --readme /dev/null || true; \
	$$py tools/plot_bandwidth.py $(BUILD)/bench --png $(BUILD)/bench/bandwidth.png || true; \
	$$py tools/plot_attention.py $(BUILD)/bench --png $(BUILD)/bench/attention.png || true; \
	$$py tools/plot_moe.py $(BUILD)/bench --png $(BUILD)/bench/moe.png || true

# Time every tile configuration of module 04 on this GPU and record the fastest for matmul().
tune: build
	$(BUILD)/bin/k2c_tune_04_register_tiled_matmul --out $(IMPL)/04_register_tiled_matmul/tuned_config.h
	cmake --build $(BUILD) -j $(JOBS)

handout: configure
	@test -n "$(OUT)" || { echo "usage: make handout OUT=dir"; exit 2; }
	cmake --build $(BUILD) --target k2c -j $(JOBS)
	$(BUILD)/bin/k2c handout $(OUT)

clean:
	rm -rf build
