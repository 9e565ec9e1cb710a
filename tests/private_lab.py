"""A small lab of its own for tests that leave state on hosts (releases, records) which the
shared session lab's other tests would trip over. Its subnet is derived from the suite's, so
suites run side by side (SGLFLEET_TEST_SUBNET) never share addresses."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .conftest import ROOT, TEST_HOSTS, TEST_LAB_DIR, TEST_SUBNET, lab_prerequisites_missing


@contextmanager
def private_lab(name: str, index: int, hosts: int, systemd: int = 0) -> Iterator:
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
    lab.up(hosts, systemd=systemd)
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


def deploy_profile(tmp_path, name, env=None, replace=None):
    """playbooks/qwen36-ddtree.yaml for the lab's stand-in: a short load delay and decode-log
    interval, a secret in its env (for redaction checks), `env` added, `replace` applied to the text."""
    text = (ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text().replace("../", f"{ROOT}/")
    fast = {"SGLFLEET_SIM_LOAD_DELAY": "0.5", "SGLFLEET_SIM_DECODE_LOG_S": "0.5", "HF_TOKEN": "hf_do_not_leak_me",
            **(env or {})}
    for key, value in fast.items():
        text = text.replace("env:\n", f"env:\n  {key}: \"{value}\"\n")
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)
