"""A small lab of its own for tests that leave state on hosts (releases, records) which the
shared session lab's other tests would trip over. Its subnet is derived from the suite's, so
suites run side by side (SGLFLEET_TEST_SUBNET) never share addresses."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .conftest import TEST_HOSTS, TEST_LAB_DIR, TEST_SUBNET, lab_prerequisites_missing


@contextmanager
def private_lab(name: str, index: int, hosts: int) -> Iterator:
    import os

    import pytest

    from orchestrator.lab.manager import Lab

    missing = lab_prerequisites_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"lab prerequisites missing in CI: {missing}")
        pytest.skip(missing)
    suite = int(TEST_SUBNET.rsplit(".", 1)[1])
    state = TEST_LAB_DIR.with_name(f"{TEST_LAB_DIR.name}-{name}")
    lab = Lab(state_dir=state, inventory_path=state.with_name(state.name + "-inventory") / "lab.yaml",
              subnet=f"127.{100 + suite}.{index}")
    lab.down()  # leftovers of an interrupted run
    lab.up(hosts)
    try:
        yield lab
    finally:
        lab.down()


def lab_fixture(name: str, index: int, hosts: int = TEST_HOSTS):
    """A module-scoped `lab` fixture on a private lab: a test module that assigns it to `lab`
    runs on hosts of its own (its deployed servers and releases never meet the shared lab's tests)."""
    import pytest

    @pytest.fixture(scope="module")
    def lab():
        with private_lab(name, index, hosts) as the_lab:
            yield the_lab

    return lab
