# sglfleet: `make demo` runs the main job on the local lab, `make test` runs the suite.
# Both set everything up on a fresh machine (as root): openssh-server, .venv, the package.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SGLFLEET := $(VENV)/bin/sglfleet
PYTHON ?= python3
# 4 pytest-xdist workers, whole modules each (a module's lab and fixtures stay in one process),
# longest module first (tests/durations.json): the suite mostly waits on lab hosts, so 4 workers
# overlap that waiting on CI's 2 cores. Each worker has a lab subnet of its own (tests/conftest.py).
PYTEST_ARGS ?= -n 4 --dist loadfile --durations=15
# The hard safety rule: nothing run from here may leave 127.0.0.0/8.
export SGLFLEET_LOOPBACK_ONLY := 1

# The network jail: `jailed CMD...` runs CMD in a private network namespace whose only interface
# is lo (brought up, so the lab's 127.0.x.N sshds work inside), so CMD cannot reach any address
# outside 127.0.0.0/8 whatever the code does, guard or no guard. Setup (apt, pip) runs before,
# outside it. Where no namespace can be made, CI (CI set, not "false"/"0") stops here rather
# than run unjailed; a local run warns and goes on with the guard and the suite's fence only.
define JAIL_SH
jailed() { \
  if unshare --net true 2>/dev/null && command -v ip >/dev/null; then \
    unshare --net -- sh -c 'ip link set lo up && exec "$$@"' jail "$$@"; \
  elif [ -n "$${CI:-}" ] && [ "$$CI" != false ] && [ "$$CI" != 0 ]; then \
    echo "make: cannot make a network namespace (unshare --net, ip): CI must not run this unjailed" >&2; \
    return 3; \
  else \
    echo "WARNING: no network jail here (unshare --net or ip failed); running with the loopback" \
         "guard and the test fence only" >&2; \
    "$$@"; \
  fi; \
}
endef

.PHONY: setup sshd demo test test-fast bench kernels lab-down clean

sshd:
	@test -x /usr/sbin/sshd || { echo "installing openssh-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; }
	@command -v ssh >/dev/null || { echo "installing openssh-client (sglfleet asks ssh -G how to reach each host)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-client >/dev/null; }
	@command -v unshare >/dev/null || { echo "unshare (util-linux) is required"; exit 1; }
	@test -x /lib/systemd/systemd || { echo "installing systemd (the systemd lab host boots it in a root of its own)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null; }
	@command -v ip >/dev/null || { echo "installing iproute2 (the network jail brings lo up with ip)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; }

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "sglfleet needs Python >= 3.11 ($(PYTHON) is older)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build kept on disk here: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,kernels,metrics]'
	@touch $@

setup: sshd $(VENV)/.installed
	# The lab's real sglang-router (its own venv under /var/cache/sglfleet; needs the package index,
	# so before any jail). Idempotent.
	$(PY) -m orchestrator.lab.router install

# The main job on the lab: facts; the DDTree extension built for the hosts' ABI (on a host, with its
# own torch); the patchset planned and pushed; the launch flags rendered with their sources; SGLang's
# own validation on every host; then the server deployed (smoke gate, launch, staged health) and its
# status shown.
# Not in the network jail, on purpose: the demo leaves its lab running for the `sglfleet`
# commands you type next, and a lab inside a namespace is unreachable from your shell (a lab
# started there would also be found "running" by a later `sglfleet lab up` out here, and fail).
# It runs with the loopback guard on and only the lab's own inventory (127.0.1.N addresses).
# bench/fanout.py shares that lab (inventory/lab.yaml), so it stays out of the jail for the same reason.
demo: setup
	$(SGLFLEET) lab up --hosts 4 --systemd 1
	$(SGLFLEET) facts all
	$(SGLFLEET) build-kernels all
	$(SGLFLEET) plan all qwen36-ddtree
	$(SGLFLEET) push all qwen36-ddtree
	$(SGLFLEET) render ct129 qwen36-ddtree
	$(SGLFLEET) smoke all qwen36-ddtree
	$(SGLFLEET) deploy all qwen36-ddtree
	$(SGLFLEET) status all qwen36-ddtree
	$(SGLFLEET) logs all --tail 2
	$(SGLFLEET) run all "cd / && /root/ml-env/bin/python3 -c 'import torch, ddtree_ext; print(ddtree_ext.__file__)'"

# The suite runs in the network jail: it feeds production addresses to the guard on purpose.
# The lab's base image is built first, outside it (its pip installs need the package index);
# without root the lab tests skip (CI runs as root) and there is no image to build.
test: setup
	@if [ "$$(id -u)" = 0 ]; then $(SGLFLEET) lab image; else echo "not root: no lab image, the lab tests skip"; fi
	@$(JAIL_SH); jailed $(PY) -m pytest $(PYTEST_ARGS)

# Local loop: skips the tests marked slow (CI runs everything).
test-fast: PYTEST_ARGS += --skip-slow
test-fast: test

# fanout.py uses the demo's lab (inventory/lab.yaml), so it stays out of the jail; deploy.py and
# rolling.py bring up labs of their own (rolling.py with the router and a client load) and run in it.
bench: setup
	$(PY) bench/fanout.py
	@$(JAIL_SH); jailed $(PY) bench/deploy.py
	@$(JAIL_SH); jailed $(PY) bench/rolling.py --down

# The DDTree extension: CPU-only here; with a CUDA torch and nvcc, CUDA for sm_90 (see kernels/ddtree/README.md).
kernels: setup
	PYTHONPATH=kernels $(PY) -m ddtree.build

lab-down: setup
	$(SGLFLEET) lab down

clean: lab-down
	rm -rf $(VENV) *.egg-info
