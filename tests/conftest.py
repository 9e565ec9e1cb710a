"""Shared fixtures. Lab tests talk to real sshd processes on loopback (see `lab` below).

The test lab has its own state dir and subnet (127.0.2.N), so a developer's own lab
(127.0.1.N, started by `make demo`) keeps running while the tests run.

Nothing in the suite may reach an address outside 127.0.0.0/8. `make test` runs it in a network
namespace with only lo (see Makefile); on top of that `network_fence` refuses any such connect in
this process and in the CLI subprocesses started through `sglfleet()` / `fenced_env()`.

Addresses: TEST_SUBNET is this suite's (SGLFLEET_TEST_SUBNET, default 127.0.2; under pytest-xdist
each worker gets its own, see worker_subnet); private labs (tests/private_lab.py) derive theirs
from it, and a test that needs a throwaway lab of its own takes spare_subnet(). Never spell a lab
address out in a test: read it from the lab (lab._host(name).address) or the inventory.

Speed (the suite's budget is ~15 min on CI's 2 cores; bench/suite.py measures a run's wall, CPU and
memory by module and by kind of process): the lab's stand-in server validates in a fork of its
host's warm validator (orchestrator/lab/sim_validator.py), so a test that starts servers pays one
SGLang import per host, not one per start. A test that must see a fresh validation child sets
SGLFLEET_SIM_WARM_S=0 in the stand-in's environment.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from . import netfence

ROOT = Path(__file__).resolve().parent.parent
# Each run's labs live under a name of their own (lab-test-run<PID>, its private labs beside it as
# lab-test-run<PID>-NAME): two runs side by side (two checkouts, or a developer's targeted run
# beside a CI clone's, each in its own network jail) used to share /var/cache/sglfleet/lab-test*,
# and each run's "down the leftovers" at start killed the other run's hosts. Labs of runs whose
# pytest is gone are taken down at the next run's start (pytest_sessionstart below).
LAB_ROOT = Path("/var/cache/sglfleet")
RUN_LAB_PREFIX = "lab-test-run"
TEST_LAB_DIR = Path(os.environ.get("SGLFLEET_TEST_LAB_DIR") or LAB_ROOT / f"{RUN_LAB_PREFIX}{os.getpid()}")
# pytest-xdist's workers (PYTEST_XDIST_WORKER gw0, gw1, ...) share one network namespace: each is a
# suite of its own, with its own subnet (the suite's third octet + 50 per worker) and labs.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
SUBNETS_PER_WORKER = 50


def worker_subnet(base: str, worker: str) -> str:
    """The subnet of `worker`'s labs, from the suite's (SGLFLEET_TEST_SUBNET, default 127.0.2)."""
    prefix, octet = base.rsplit(".", 1)
    number = int(worker[2:]) if worker.startswith("gw") else 0
    third = int(octet) + SUBNETS_PER_WORKER * number
    if third > 155:  # private labs live on 127.(100 + third).N
        raise pytest.UsageError(f"pytest-xdist worker {worker} would take subnet {prefix}.{third}: too many "
                                f"workers for SGLFLEET_TEST_SUBNET {base} (at most {1 + (155 - int(octet)) // 50})")
    return f"{prefix}.{third}"


TEST_SUBNET = worker_subnet(os.environ.get("SGLFLEET_TEST_SUBNET", "127.0.2"), XDIST_WORKER)  # side by side: pick another
TEST_HOSTS = 8  # the smoke test fans out to 8 hosts
# Module -> seconds it took in a recent whole run (bench/suite.py --write-durations writes it).
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def spare_subnet() -> str:
    """A second subnet of this suite's own, beside TEST_SUBNET (for a test's throwaway lab)."""
    prefix, octet = TEST_SUBNET.rsplit(".", 1)
    return f"{prefix}.{int(octet) + 1}"

# Every test runs under the loopback-only rule.
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"
FENCE_SITE = Path(__file__).resolve().parent / "fence_site"
_fence_log: Path | None = None  # set by `network_fence` for the session


def network_interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def in_network_jail() -> bool:
    """True inside a network namespace whose only interface is lo (`make test`'s jail)."""
    return network_interfaces() == ["lo"]


def pytest_report_header(config):
    if in_network_jail():
        return "network jail: yes (only lo in this network namespace)"
    return (f"network jail: NO (interfaces {', '.join(network_interfaces())}); run the suite with `make test`, "
            f"which jails it")


@pytest.fixture(scope="session", autouse=True)
def network_fence(tmp_path_factory):
    """For the whole session: a connect, send or name lookup outside 127.0.0.0/8 raises."""
    global _fence_log
    _fence_log = tmp_path_factory.getbasetemp() / "netfence.log"
    _fence_log.touch()
    netfence.install(str(_fence_log))
    yield _fence_log
    netfence.uninstall()
    _fence_log = None


@pytest.fixture(autouse=True)
def _no_fence_hits(network_fence):
    """A test during which the fence refused something fails, even if the code swallowed the error."""
    start = network_fence.stat().st_size
    yield
    with open(network_fence, encoding="utf-8") as fh:
        fh.seek(start)
        hits = fh.read()
    if hits:
        pytest.fail(f"this test tried to leave 127.0.0.0/8 (refused by the fence):\n{hits}", pytrace=False)


def fenced_env(extra: dict | None = None) -> dict[str, str]:
    """os.environ for a Python subprocess of a test: guard on and the network fence installed."""
    env = {**os.environ, "SGLFLEET_LOOPBACK_ONLY": "1"}
    # pytest-xdist's workers inherit COLUMNS=80 from their terminal setup: the CLI (cli/output.py)
    # would size its tables to it and wrap the words a test looks for. Off a terminal it uses 160.
    env.pop("COLUMNS", None)
    if _fence_log is not None:
        env["SGLFLEET_TEST_FENCE_LOG"] = str(_fence_log)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FENCE_SITE), os.environ.get("PYTHONPATH")) if p)
    return {**env, **(extra or {})}


def stale_run_labs(root: Path = LAB_ROOT) -> list[Path]:
    """Lab dirs (and their -inventory dirs) of earlier runs whose pytest process is gone."""
    import re

    from orchestrator.lab.manager import _alive

    stale = []
    for path in sorted(root.glob(f"{RUN_LAB_PREFIX}*")) if root.is_dir() else []:
        match = re.match(rf"{RUN_LAB_PREFIX}(\d+)(?:-|$)", path.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            stale.append(path)
    return stale


def pytest_sessionstart(session):
    if os.geteuid() != 0 or os.environ.get("SGLFLEET_TEST_LAB_DIR"):
        return
    from orchestrator.lab.manager import Lab

    for path in stale_run_labs():
        if not path.name.endswith("-inventory"):
            try:
                Lab(state_dir=path, inventory_path=path.with_name(path.name + "-inventory") / "lab.yaml").down()
            except Exception as exc:  # noqa: BLE001 - a broken leftover must not stop the run
                print(f"could not take down the leftover lab {path}: {exc}", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)


def pytest_configure(config):
    # build-kernels' cache of this checkout (build/ddtree-builds, filled by `make demo`) would make
    # plan, push and deploy ship its builds in every test that deploys a profile with an
    # extension: the suite starts from an empty cache of its own, as on a fresh clone (tests of
    # the cache set their own).
    import tempfile

    os.environ["SGLFLEET_KERNEL_CACHE"] = config._sglfleet_kernel_cache = tempfile.mkdtemp(
        prefix="sglfleet-test-kernel-cache-")
    if getattr(config.option, "loadscopereorder", None) and DURATIONS.is_file():  # see longest_first
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    cache = getattr(config, "_sglfleet_kernel_cache", None)
    if cache:  # every pytest process (xdist's workers too) made one; none is left in /tmp
        shutil.rmtree(cache, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", help="skip tests marked slow (CI runs them)")


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """`items` with the modules that took longest first, each module's own order kept. A module
    not in `seconds` (new since the file was written) counts as the longest: an unknown module
    started last could be the run's tail."""
    unknown = max(seconds.values(), default=0.0) + 1.0
    return sorted(items, key=lambda item: -seconds.get(item.path.name, unknown))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--skip-slow"):
        skip = pytest.mark.skip(reason="--skip-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    # Under pytest-xdist with --dist loadfile each worker takes whole modules in the workers'
    # collection order (pytest_configure turns xdist's own reorder, by test count, off: a module
    # of 3 lab tests can take longer than one of 300 unit tests). Started longest first, the run
    # does not end waiting on one long module begun last.
    if XDIST_WORKER and DURATIONS.is_file():
        import json

        items[:] = longest_first(items, json.loads(DURATIONS.read_text()))


def lab_prerequisites_missing() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root"
    if not os.path.exists("/usr/sbin/sshd"):
        return "openssh-server is not installed (make test installs it)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    return None


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A running lab of TEST_HOSTS hosts; torn down at the end of the session."""
    missing = lab_prerequisites_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"lab prerequisites missing in CI: {missing}")
        pytest.skip(missing)
    from orchestrator.lab.manager import Lab

    inv_dir = tmp_path_factory.mktemp("inventory")
    the_lab = Lab(state_dir=TEST_LAB_DIR, inventory_path=inv_dir / "lab.yaml", subnet=TEST_SUBNET)
    the_lab.down()  # leftovers of an interrupted run
    the_lab.up(TEST_HOSTS)
    yield the_lab
    the_lab.down()


@pytest.fixture
def inventory(lab):
    from orchestrator.fleet.inventory import load_inventory

    return load_inventory(lab.inventory_path)


@pytest.fixture
def conn(inventory):
    from orchestrator.fleet.hostkeys import KnownHosts
    from orchestrator.fleet.transport import Connection

    c = Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path))
    yield c
    c.close()


def sglfleet(*args: str, env: dict | None = None, cwd: Path | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real CLI in a process of its own, as a user would (fenced: see `fenced_env`): a fork
    of this pytest process's CLI zygote, which has imported it (tests/cli_zygote.py), or a fresh
    interpreter where the zygote would not behave as one."""
    from .cli_zygote import zygote_for

    full_env = fenced_env(env)
    zygote = zygote_for(fenced_env(), ROOT)
    why_not = zygote.why_not(full_env) if zygote is not None else "no zygote"
    if not why_not:
        return zygote.run(list(args), full_env, cwd or ROOT, timeout=timeout)
    if os.environ.get("SGLFLEET_TEST_ZYGOTE_LOG"):  # which calls started fresh, and why
        with open(os.environ["SGLFLEET_TEST_ZYGOTE_LOG"], "a") as log:
            log.write(f"{XDIST_WORKER or 'main'} {os.environ.get('PYTEST_CURRENT_TEST')}: {why_not}\n")
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout)


def under_load(url: str, call, rate: float = 8, clients: int = 8, warmup: float = 2.0) -> tuple[object, dict]:
    """`call()` under a steady client load through `url` (started `warmup` s before, stopped once
    it returns): (its result, the load's summary plus `during_call`, the requests scheduled while
    it ran, and `offered_during`, what the rate offered over that time). Assert on those two, not
    on a total fixed in advance: a total follows the call's speed, not the load's reach."""
    import time

    from orchestrator.lab.loadgen import LoadGenerator

    load = LoadGenerator(url, rate=rate, clients=clients, duration=900, max_new_tokens=4).start()
    time.sleep(warmup)
    began = time.monotonic()
    try:
        result = call()
    finally:
        ended = time.monotonic()
        load.stop()
    report = load.wait()
    return result, dict(report.summary(), during_call=len(report.window(began, ended)),
                        offered_during=round(rate * (ended - began)))
