# Two entry points: `make demo` (the whole pipeline on the local lab) and
# `make test` (the test suite, integration tests included). Both install what
# they need: Debian packages (as root) and a virtualenv in .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
APT_PACKAGES := golang-go golang-github-vmware-govmomi-dev openssh-server openssh-client \
                numactl iproute2 chromium debootstrap
DEMO_MODEL ?= synthetic:tiny
# DEMO_FRESH=1: the demo on fresh Debian guests in namespaces of their own (root only).
DEMO_FRESH ?=
PYTEST_ARGS ?=

.PHONY: setup apt venv test demo lint clean lab-down peers

setup: apt venv

# Debian packages: vcsim sources and Go, sshd for the lab guests, numactl for
# pinning, Chromium for rendering the report in tests, debootstrap for the fresh guests' root.
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

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[bench,dev]'
	touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check vcfslm tests benchmarks

demo: setup
	DEMO_MODEL=$(DEMO_MODEL) DEMO_FRESH=$(DEMO_FRESH) VCFSLM=$(VENV)/bin/vcfslm PYTHON=$(PY) bash scripts/demo.sh

# The peer engines benchmarks/peers.py measures beside vcfslm, in .venv-peers (not for
# make test or CI: llama-cpp-python builds from source, ~9 minutes on 2 cores).
peers: venv
	bash benchmarks/peers-setup.sh

lab-down: venv
	$(VENV)/bin/vcfslm lab down

clean:
	rm -rf $(VENV) build dist .pytest_cache
