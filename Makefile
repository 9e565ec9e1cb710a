# sglfleet: `make demo` runs the main job on the local lab, `make test` runs the suite.
# Both set everything up on a fresh machine (as root): openssh-server, .venv, the package.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SGLFLEET := $(VENV)/bin/sglfleet
PYTHON ?= python3
PYTEST_ARGS ?=
# The hard safety rule: nothing run from here may leave 127.0.0.0/8.
export SGLFLEET_LOOPBACK_ONLY := 1

.PHONY: setup sshd demo test test-fast bench kernels lab-down clean

sshd:
	@test -x /usr/sbin/sshd || { echo "installing openssh-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; }
	@command -v unshare >/dev/null || { echo "unshare (util-linux) is required"; exit 1; }

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "sglfleet needs Python >= 3.11 ($(PYTHON) is older)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build kept on disk here: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,kernels]'
	@touch $@

setup: sshd $(VENV)/.installed

# The main job on the lab: facts, then the DDTree patchset planned and pushed, the launch flags
# rendered (with their sources), and SGLang's own validation run on every host.
demo: setup
	$(SGLFLEET) lab up --hosts 4
	$(SGLFLEET) facts all
	$(SGLFLEET) plan all qwen36-ddtree
	$(SGLFLEET) push all qwen36-ddtree
	$(SGLFLEET) render ct129 qwen36-ddtree
	$(SGLFLEET) smoke all qwen36-ddtree

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Local loop: skips the tests marked slow (CI runs everything).
test-fast: PYTEST_ARGS += --skip-slow
test-fast: test

bench: setup
	$(PY) bench/fanout.py

# The DDTree extension: CPU-only here; with a CUDA torch and nvcc, CUDA for sm_90 (see kernels/ddtree/README.md).
kernels: setup
	$(PY) -m kernels.ddtree.build

lab-down: setup
	$(SGLFLEET) lab down

clean: lab-down
	rm -rf $(VENV) *.egg-info
