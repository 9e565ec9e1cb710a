"""Inventory loading, variable precedence, ssh_config, patterns, and file:line errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import load_inventory

from .conftest import ROOT, sglfleet

FLEET = """\
all:
  vars:
    user: deploy
    python: /usr/bin/python3
  hosts:
    ct129: {address: 127.0.0.11}
    ct130: {ansible_host: 127.0.0.12, ansible_port: 2222, ansible_user: admin}
    ct131: {address: 127.0.0.13, ansible_host: 127.0.0.99}
    db1: {address: 127.0.0.20}
  children:
    gpu-fleet:
      vars: {models_dir: /data/models}
      hosts: {ct129: , ct130: , ct131: }
      children:
        h200:
          vars: {models_dir: /nvme/models}
          hosts: {ct130: {python: /root/ml-env/bin/python3}}
    lab:
      hosts: {ct129: , db1: }
"""


def write(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def fleet(tmp_path):
    return load_inventory(write(tmp_path, FLEET), ssh_config_path=str(tmp_path / "none"))


def names(inv, pattern):
    return [h.name for h in inv.select(pattern)]


def test_ansible_and_own_names_and_precedence(fleet):
    ct129, ct130, ct131 = fleet.hosts["ct129"], fleet.hosts["ct130"], fleet.hosts["ct131"]
    assert (ct129.address, ct129.port, ct129.user) == ("127.0.0.11", 22, "deploy")
    assert (ct130.address, ct130.port, ct130.user) == ("127.0.0.12", 2222, "admin")
    assert ct131.address == "127.0.0.13"  # our name wins over the Ansible alias
    # all.vars < gpu-fleet < h200 (deeper) < host vars
    assert ct129.models_dir == "/data/models"
    assert ct130.models_dir == "/nvme/models"
    assert ct130.python == "/root/ml-env/bin/python3"
    assert ct129.python == "/usr/bin/python3"
    assert set(ct130.groups) == {"gpu-fleet", "h200"}


@pytest.mark.parametrize("pattern,expected", [
    ("ct129", ["ct129"]),
    ("all", ["ct129", "ct130", "ct131", "db1"]),
    ("*", ["ct129", "ct130", "ct131", "db1"]),
    ("gpu-fleet", ["ct129", "ct130", "ct131"]),
    ("ct1*", ["ct129", "ct130", "ct131"]),
    ("ct129,db1", ["ct129", "db1"]),
    ("ct129:db1", ["ct129", "db1"]),
    ("gpu-fleet:!ct130", ["ct129", "ct131"]),
    ("gpu-fleet:&lab", ["ct129"]),
    ("gpu-fleet,lab:!h200", ["ct129", "ct131", "db1"]),
    ("!db1", ["ct129", "ct130", "ct131"]),
    ("~ct13[01]", ["ct130", "ct131"]),
    ("h2*", ["ct130"]),  # globs match group names too
])
def test_patterns(fleet, pattern, expected):
    assert names(fleet, pattern) == expected


@pytest.mark.parametrize("pattern,message", [
    ("gpu-flet", "did you mean 'gpu-fleet'"),
    ("ct999", "'ct999' is not a host or group"),
    ("gpu-fleet:&db1", "matches no host"),
    ("", "empty host pattern"),
])
def test_pattern_errors(fleet, pattern, message):
    with pytest.raises(ConfigError, match=message):
        fleet.select(pattern)


def test_ssh_config_fills_gaps_and_inventory_wins(tmp_path):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(textwrap.dedent("""\
        Host ct129
            HostName 127.0.0.50
            Port 2200
            User sshcfg
            IdentityFile ~/.ssh/ct129_key
            ProxyJump bastion
        Host ct130
            HostName 127.0.0.60
            User sshcfg
    """))
    inv_path = write(tmp_path, """\
        all:
          hosts:
            ct129: {}
            ct130: {user: inventory-user, port: 2022}
    """)
    inv = load_inventory(inv_path, ssh_config_path=str(ssh_config))
    ct129, ct130 = inv.hosts["ct129"], inv.hosts["ct130"]
    assert (ct129.address, ct129.port, ct129.user, ct129.proxy_jump) == ("127.0.0.50", 2200, "sshcfg", "bastion")
    assert ct129.identity_files == (str(Path("~/.ssh/ct129_key").expanduser()),)
    assert (ct130.address, ct130.port, ct130.user) == ("127.0.0.60", 2022, "inventory-user")


@pytest.mark.parametrize("text,line,message", [
    ("all:\n  hosts:\n    ct129: {address: [1, 2\n", 4, "invalid YAML"),
    ("all:\n  hosts:\n    ct129:\n      adress: 127.0.0.1\n", 4, "unknown key 'adress' in host 'ct129' (did you mean 'address'?)"),
    ("all:\n  hostz:\n    ct129:\n", 2, "unknown key 'hostz' in group 'all' (did you mean 'hosts'?)"),
    ("all:\n  hosts:\n    ct129:\n      port: twenty-two\n", 4, "'port' of host 'ct129' must be an integer port number"),
    ("all:\n  vars:\n    host_key_policy: yolo\n  hosts: {a: }\n", 3, "must be one of strict, accept-new"),
    ("all:\n  children:\n    gpu: [ct129]\n", 3, "group 'gpu' must be a mapping"),
    ("all:\n  hosts:\n    ct129:\n    ct129:\n", 4, "duplicate key 'ct129'"),
    ("all:\n  children:\n    empty:\n", 1, "defines no hosts"),
])
def test_bad_inventory_reports_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_inventory(path, ssh_config_path=str(tmp_path / "none"))
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert message in str(info.value)


def test_user_vars_are_kept(tmp_path):
    inv = load_inventory(write(tmp_path, "all:\n  hosts:\n    a: {lab_gpu: h200, rack: r7}\n"),
                         ssh_config_path=str(tmp_path / "none"))
    assert inv.hosts["a"].vars["lab_gpu"] == "h200"
    assert inv.hosts["a"].vars["rack"] == "r7"


def test_production_example_is_valid_data():
    inv = load_inventory(ROOT / "inventory" / "production.example.yaml", ssh_config_path="/nonexistent")
    ct129 = inv.hosts["ct129"]
    assert (ct129.address, ct129.user) == ("10.1.230.172", "root")
    assert ct129.python == "/root/ml-env/bin/python3"
    assert ct129.models_dir == "/root/models"
    assert "gpu-fleet" in ct129.groups


def test_cli_config_error_is_one_paragraph_exit_2(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    ct129:\n      prot: 22\n")
    proc = sglfleet("hosts", "all", "-i", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{path}:4: unknown key 'prot'" in proc.stderr.replace("\n", "")
    proc = sglfleet("hosts", "gpu-flet", "-i", str(ROOT / "inventory" / "production.example.yaml"))
    assert proc.returncode == 2 and "did you mean 'gpu-fleet'" in proc.stderr.replace("\n", "")


def test_cli_hosts_json_lists_selection_without_connecting():
    proc = sglfleet("hosts", "gpu-fleet", "-i", str(ROOT / "inventory" / "production.example.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    import json
    doc = json.loads(proc.stdout)
    assert [h["name"] for h in doc["hosts"]][0] == "ct129"
