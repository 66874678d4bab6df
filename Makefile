# TrainStream: the two commands users need are `make demo` and `make test`.
# Each one installs what is missing (system packages, the project venv),
# configures and builds. See README.md.
PYTHON ?= python3
VENV ?= .venv
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)
VENV_PY := $(abspath $(VENV))/bin/python
PYTEST_ARGS ?=
# ccache, when installed, for every build: `make test`'s second build (the wheel's,
# in $(BUILD)-pip, at the depth of $(BUILD)) then reuses the first one's objects.
# Looked up when a configure recipe runs (`=`), after `make deps` has installed it.
CCACHE = $(shell command -v ccache 2>/dev/null)
LAUNCHER_ARGS = $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE) -DCMAKE_CUDA_COMPILER_LAUNCHER=$(CCACHE))
# Paths under base_dir are hashed relative to the build dir, so it must hold the
# checkout: the configured base_dir when it does (one above several checkouts), else
# the checkout itself.
ccache_conf_base = $(shell ccache -k base_dir 2>/dev/null)
export CCACHE_BASEDIR ?= $(if $(and $(ccache_conf_base),$(filter $(ccache_conf_base)/%,$(CURDIR)/)),$(ccache_conf_base),$(CURDIR))
export CCACHE_NOHASHDIR ?= 1

.PHONY: all deps venv configure build test test-cpp test-python test-install lint demo clean format gpu-check sanitize

all: build

deps:
	@scripts/install-system-deps.sh

venv: deps
	@PYTHON=$(PYTHON) VENV=$(VENV) scripts/setup-venv.sh

$(BUILD)/CMakeCache.txt:
	@$(MAKE) --no-print-directory venv
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DPython_EXECUTABLE=$(VENV_PY) $(LAUNCHER_ARGS) $(CMAKE_ARGS)

configure: venv
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DPython_EXECUTABLE=$(VENV_PY) $(LAUNCHER_ARGS) $(CMAKE_ARGS)

build: venv $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	@$(MAKE) --no-print-directory test-cpp test-python test-install

test-cpp:
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python:
	PYTHONPATH=$(abspath $(BUILD))/python TRAINSTREAM_BUILD_DIR=$(abspath $(BUILD)) \
	  $(VENV_PY) -m pytest -q tests/python $(PYTEST_ARGS)

# `pip install --no-build-isolation .` into a fresh venv, used from outside the
# checkout, then uninstalled (tests/install/test_install.py).
test-install: venv
	env -u PYTHONPATH -u TRAINSTREAM_BUILD_DIR TRAINSTREAM_INSTALL_BUILD_DIR=$(abspath $(BUILD))-pip \
	  TRAINSTREAM_INSTALL_LIKE=$(abspath $(BUILD)) \
	  $(VENV_PY) -m pytest -q -s -p no:cacheprovider tests/install $(PYTEST_ARGS)

# ruff, configured in pyproject.toml; installed into the venv on first use (pinned).
RUFF_VERSION ?= 0.17.6
lint: venv
	@$(VENV_PY) -m ruff --version 2>/dev/null | grep -q " $(RUFF_VERSION)$$" || \
	  $(VENV_PY) -m pip install -q --disable-pip-version-check ruff==$(RUFF_VERSION)
	$(VENV_PY) -m ruff check python tests benchmarks examples scripts

demo: build
	PYTHONPATH=$(abspath $(BUILD))/python TRAINSTREAM_BUILD_DIR=$(abspath $(BUILD)) \
	  $(VENV_PY) examples/demo.py

# AddressSanitizer + UndefinedBehaviorSanitizer: the daemon, the clients and the C++
# tests (no Python package, no CUDA) in $(SAN_BUILD), then ctest there. Not in CI
# (about 20 minutes on 2 cores). Every report is fatal. handle_sigbus=0: the memory
# guard's test checks that a child dies of SIGBUS, which ASan would catch first.
# `TRAINSTREAM_BUILD_DIR` pointing at a directory whose bin/ holds these binaries
# runs the Python tests against the sanitized daemon (docs/building.md, "Sanitizers").
SAN_BUILD ?= build-asan
SAN_FLAGS ?= -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
sanitize: deps
	cmake -S . -B $(SAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTRAINSTREAM_WITH_PYTHON=OFF \
	  -DTRAINSTREAM_BUILD_BENCHMARKS=OFF -DTRAINSTREAM_WITH_CUDA=OFF $(LAUNCHER_ARGS) \
	  "-DCMAKE_CXX_FLAGS=$(SAN_FLAGS)" "-DCMAKE_EXE_LINKER_FLAGS=$(SAN_FLAGS)" \
	  "-DCMAKE_SHARED_LINKER_FLAGS=$(SAN_FLAGS)"
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:handle_sigbus=0 \
	  UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' '*.cpp')

gpu-check:
	scripts/gpu-check.sh

clean:
	rm -rf $(BUILD) $(BUILD)-pip $(SAN_BUILD)
