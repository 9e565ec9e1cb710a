"""Fuzzing the files users write: inventories and profiles.

Every case must end as a loaded inventory/profile or as a ConfigError (exit 2, one paragraph,
with the file named): never another exception, which the CLI would show as a traceback. Cases
are random YAML structures mutated from real ones, random scalars in every position, and random
bytes. A handful also go through the real CLI, which must print no traceback.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import SglfleetError
from orchestrator.fleet.inventory import load_inventory
from orchestrator.spec.profile import load_profile

from .conftest import ROOT, sglfleet

INVENTORY = {
    "all": {
        "vars": {"ansible_user": "root", "ansible_python_interpreter": "/root/ml-env/bin/python3",
                 "sglfleet_profile_overrides": {"qwen36-ddtree": {"server": {"port": 30001}}}},
        "children": {
            "gpu-fleet": {"hosts": {"ct129": {"ansible_host": "127.0.1.1", "ansible_port": 22},
                                    "ct130": {"ansible_host": "127.0.1.2", "sglfleet_proxy_jump": "ct129"}},
                          "vars": {"sglfleet_models_dir": "/root/models"}},
            "lab": {"children": {"gpu-fleet": {}}, "hosts": {"ct131": None}},
        },
    }
}
PROFILE = yaml.safe_load((ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text())
PROFILE["artifacts"] = {}  # artifacts point at files relative to the profile; fuzz the rest

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**40, max_value=2**40),
                    st.floats(allow_nan=True), st.text(max_size=30),
                    st.sampled_from(["", ":", ",", "!", "&", "~(", "[1:", "h[01:99]", "0.0.0.0", "10.0.0.1",
                                     "host:abc", "../..", "\n", "a\x00b", "-5", "0"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, prefix + (index,))
    return out


@st.composite
def mutated(draw: Any, base: dict) -> Any:
    """`base` with a few random nodes replaced, deleted or given extra keys."""
    document = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = [p for p in _paths(document) if p]
        if not paths or not isinstance(document, dict):
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(values)
    return document


def _dump(document: Any) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True).encode("utf-8")


def _check(loader: Any, data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            loader(path)
        except SglfleetError as exc:
            assert exc.exit_code == 2, (type(exc).__name__, str(exc))
            message = str(exc)
            assert message and "Traceback" not in message
            assert str(path) in message or "inventory" in message or "profile" in message, message


def _load_inventory(path: Path) -> None:
    inventory = load_inventory(path)
    for pattern in ("all", "gpu-fleet", "ct1*", "gpu-fleet:!ct130"):
        try:
            inventory.select(pattern)
        except SglfleetError as exc:  # a term matching nothing in a mutated inventory: bad input, exit 2
            assert exc.exit_code == 2


def _load_profile(path: Path) -> None:
    load_profile(str(path)).artifacts()


FUZZ = settings(max_examples=int(os.environ.get("SGLFLEET_FUZZ_EXAMPLES", "300")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated(INVENTORY))
def test_mutated_inventories_load_or_fail_with_a_config_error(document):
    _check(_load_inventory, _dump(document), "inventory.yaml")


@FUZZ
@given(mutated(PROFILE))
def test_mutated_profiles_load_or_fail_with_a_config_error(document):
    _check(_load_profile, _dump(document), "profile.yaml")


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=600))
def test_random_bytes_in_an_inventory_or_profile(noise, at):
    for base, loader, name in ((INVENTORY, _load_inventory, "inventory.yaml"), (PROFILE, _load_profile, "p.yaml")):
        text = _dump(base)
        at = min(at, len(text))
        _check(loader, text[:at] + noise + text[at:], name)


def test_the_cli_prints_no_traceback_for_broken_files(tmp_path):
    """The same classes through the real CLI (a few cases: each is a process start)."""
    cases = [b"\xff\xfe not utf-8", b"all: [1, 2", b"all:\n  hosts: ct129\n", b"all:\n  children: 7\n",
             b"all:\n  hosts:\n    ct129: {ansible_host: 127.0.0.5, sglfleet_proxy_jump: 'host:abc'}\n"]
    for index, data in enumerate(cases):
        inventory = tmp_path / f"inv{index}.yaml"
        inventory.write_bytes(data)
        proc = sglfleet("hosts", "all", "-i", str(inventory))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, (data, proc.stderr)
        assert str(inventory) in " ".join(proc.stderr.split()), proc.stderr
