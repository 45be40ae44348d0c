# Kernels to Clusters — a thin wrapper over CMake. Every target brings its own set-up, so on a
# fresh machine `make grade IMPL=solutions` and `make test` each work as the first command.
#
#   make deps                       check what the build needs by what it does (tools/deps.sh):
#                                   CMake >= 3.25, C++20, the libraries as CMake finds them;
#                                   install what is missing (as root, apt-get) or print the
#                                   command; fails only when a required piece is still missing
#   make build   [IMPL=...]         configure and build build/<IMPL> (assignments by default)
#   make test                       the project's own test suite (CPU; GPU tests skip without a GPU)
#   make grade   [IMPL=...] [MODULES=00,01] [SEED=n] [ARGS="--json r.json ..."]
#   make bench   [IMPL=...]         every module's benchmark sweep and the SGEMM ladder plot (GPU)
#   make tune    [IMPL=...]         choose module 04's tile configuration for this GPU
#   make data                       Part II's token shards: datasets/markov/, datasets/grammar/
#   make handout OUT=dir            a student tree without solutions/, with the students' README
#                                   (docs/README.handout.md as its README.md)
#   make figures                    rewrite the measured figures and tables of the docs from
#                                   autograder/reference/h200.json and lab/results/h200.json
#                                   (make test checks them)
#   make clean
IMPL    ?= assignments
MODULES ?=
SEED    ?=
ARGS    ?=
BUILD   := build/$(IMPL)
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)

.PHONY: deps configure build test grade bench tune data handout figures clean

# Tools from pip, conda or a build by hand count as present: apt-get runs only for what is really
# missing, so a machine that has everything never needs the package manager or its network.
deps:
	@tools/deps.sh

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
	$$py tools/plot_ladder.py $(BUILD)/bench --png $(BUILD)/bench/sgemm_ladder.png || true; \
	$$py tools/plot_bandwidth.py $(BUILD)/bench --png $(BUILD)/bench/bandwidth.png || true; \
	$$py tools/plot_attention.py $(BUILD)/bench --png $(BUILD)/bench/attention.png || true; \
	$$py tools/plot_moe.py $(BUILD)/bench --png $(BUILD)/bench/moe.png || true

# Time every tile configuration of module 04 on this GPU and record the fastest for matmul().
tune: build
	$(BUILD)/bin/k2c_tune_04_register_tiled_matmul --out $(IMPL)/04_register_tiled_matmul/tuned_config.h
	cmake --build $(BUILD) -j $(JOBS)

# Part II's token data, written from fixed seeds so every machine trains on the same tokens:
# a Markov chain whose entropy rate (datasets/markov/markov.json) is the exact loss floor, and
# word-level sentences for readable samples. The generator is course code, not a module, so the
# build tree only matters for where it lands: build/solutions, or build/assignments in a handout.
DATA_BUILD := build/$(if $(wildcard solutions),solutions,assignments)

data: deps
	@test -f $(DATA_BUILD)/CMakeCache.txt || cmake -S . -B $(DATA_BUILD) $(GENERATOR) -DK2C_IMPL=$(notdir $(DATA_BUILD))
	cmake --build $(DATA_BUILD) --target k2c_datagen -j $(JOBS)
	$(DATA_BUILD)/bin/k2c_datagen markov --vocab 256 --branching 8 --tokens 4000000 --seed 1 --out datasets/markov
	$(DATA_BUILD)/bin/k2c_datagen grammar --sentences 200000 --seed 1 --out datasets/grammar

handout: configure
	@test -n "$(OUT)" || { echo "usage: make handout OUT=dir"; exit 2; }
	cmake --build $(BUILD) --target k2c -j $(JOBS)
	$(BUILD)/bin/k2c handout $(OUT)

# Every measured number in the lectures, handouts and README sits between markers that
# tools/figures.py fills from the reference file; CTest's docs.figures fails when one is stale.
figures:
	python3 tools/figures.py --write

clean:
	rm -rf build
