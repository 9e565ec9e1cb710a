"""What `sglfleet hosts` says of the ssh config (Match exec, where each value came from), the config
in use, and the loopback guard on every hop and ProxyCommand. No connection is made."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from orchestrator.errors import ConfigError, LoopbackOnlyError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.inventory import load_inventory
from orchestrator.fleet.transport import Connection

from .conftest import sglfleet

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="openssh-client is not installed")


def _files(tmp_path, config: str, inventory: str):
    cfg, inv = tmp_path / "ssh_config", tmp_path / "inv.yaml"
    cfg.write_text(config)
    inv.write_text(inventory)
    return cfg, inv


def test_hosts_does_not_run_match_exec_and_says_so(tmp_path):
    marker = tmp_path / "exec-ran"
    cfg, inv = _files(tmp_path, f'Host *\n    Port 2200\nMatch exec "touch {marker}"\n    User execd\n',
                      "all:\n  hosts:\n    web1: {ansible_host: 127.0.0.5}\n")
    env = {"SGLFLEET_SSH_CONFIG": str(cfg)}
    done = sglfleet("hosts", "-i", str(inv), "--json", env=env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert not marker.exists(), "sglfleet hosts promises no connection and ran a Match exec command"
    (note,) = doc["match_exec"]
    assert (note["where"], note["ran"], note["hosts"]) == (f"{cfg}:3", False, ["web1"])
    assert "did not run it" in note["note"] and doc["hosts"][0]["user"] != "execd"
    table = sglfleet("hosts", "-i", str(inv), env=env)
    assert f"{cfg}:3: the ssh config has Match exec" in table.stderr and not marker.exists()
    ran = json.loads(sglfleet("hosts", "-i", str(inv), "--json", "--match-exec", env=env).stdout)
    assert marker.exists() and ran["match_exec"][0]["ran"] is True and ran["hosts"][0]["user"] == "execd"


def test_hosts_json_says_where_each_value_came_from(tmp_path):
    cfg, inv = _files(tmp_path, "Host web1\n    Hostname 127.0.0.5\n    Port 2200\n    ProxyJump hop\n"
                                "Host hop\n    Hostname 127.0.0.6\n    User jumper\n",
                      "all:\n  hosts:\n    web1:\n      ansible_user: deploy\n")
    done = sglfleet("hosts", "-i", str(inv), "web1", "--json", env={"SGLFLEET_SSH_CONFIG": str(cfg)})
    assert done.returncode == 0, done.stderr
    ssh = json.loads(done.stdout)["hosts"][0]["ssh"]
    assert ssh["address"] == {"value": "127.0.0.5", "from": f"{cfg}:2"}
    assert ssh["port"] == {"value": 2200, "from": f"{cfg}:3"}
    assert ssh["user"] == {"value": "deploy", "from": f"{inv}:4 (ansible_user)"}
    assert ssh["proxy_jump"] == {"value": "hop", "from": f"{cfg}:4"}
    assert ssh["identity_files"]["from"] == "OpenSSH default" and ssh["config"] == str(cfg)
    (hop,) = ssh["via"]
    assert (hop["address"], hop["user"]) == ({"value": "127.0.0.6", "from": f"{cfg}:6"},
                                             {"value": "jumper", "from": f"{cfg}:7"})


def test_a_missing_ssh_config_named_by_the_env_is_an_error(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("all:\n  hosts:\n    web1: {ansible_host: 127.0.0.5}\n")
    done = sglfleet("hosts", "-i", str(inv), env={"SGLFLEET_SSH_CONFIG": str(tmp_path / "nope")})
    assert done.returncode == 2
    assert f"SGLFLEET_SSH_CONFIG names '{tmp_path / 'nope'}', which is not a file" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_refused_config_is_named_in_the_error(tmp_path, monkeypatch):
    cfg, inv = _files(tmp_path, "Host *\n    Prot 22\n", "all:\n  hosts:\n    web1: {ansible_host: 127.0.0.5}\n")
    monkeypatch.setenv("SGLFLEET_SSH_CONFIG", str(cfg))
    with pytest.raises(ConfigError, match=rf"{cfg}: line 2: Bad configuration option: prot.*config in use: {cfg}"):
        load_inventory(inv).select("all")


GUARDED = """\
Host multi
    Hostname 127.0.0.5
    ProxyJump 127.0.0.6,10.1.2.3
Host notnc
    Hostname 127.0.0.7
    ProxyCommand /usr/bin/touch {marker}
Host ncout
    ProxyCommand nc 10.0.0.1 22
Host shell
    ProxyCommand nc 127.0.0.1 22; touch {marker}
Host ncok
    Hostname 127.0.0.8
    ProxyCommand nc -w5 %h %p
"""


@pytest.mark.parametrize("name,refusal", [
    ("multi", "jump host of multi '10.1.2.3'"),
    ("notnc", "where it connects cannot be read off it"),
    ("ncout", "(its ProxyCommand) '10.0.0.1'"),
    ("shell", "it uses shell syntax"),
])
def test_the_loopback_guard_checks_every_hop_and_proxy_command(tmp_path, name, refusal):
    marker = tmp_path / "proxy-command-ran"
    cfg, inv = _files(tmp_path, GUARDED.format(marker=marker),
                      "all:\n  hosts:\n" + "".join(f"    {h}:\n" for h in ("multi", "notnc", "ncout", "shell", "ncok")))
    hosts = {h.name: h for h in load_inventory(inv, ssh_config_path=str(cfg)).select("all")}
    with pytest.raises(LoopbackOnlyError) as info:
        Connection(hosts[name], KnownHosts(tmp_path / "known_hosts"), connect_attempts=1).open()
    assert refusal in str(info.value) and "No co" in str(info.value)
    assert not marker.exists()
    # nc to a loopback address (the host's own, from %h) passes the guard's check
    ok = Connection(hosts["ncok"], KnownHosts(tmp_path / "known_hosts"))
    ok._check_route(ok.route())
    assert hosts["ncok"].ssh.proxy_command == "nc -w5 127.0.0.8 22"


def test_answers_kept_on_disk_are_used_until_a_config_file_changes(tmp_path, monkeypatch):
    from orchestrator.fleet import ssh_resolve

    (tmp_path / "conf.d").mkdir()
    included = tmp_path / "conf.d" / "50-x.conf"
    included.write_text("Host 127.0.0.5\n    Port 2201\n")
    cfg, inv = _files(tmp_path, f"Include {tmp_path}/conf.d/*.conf\n", "all:\n  hosts:\n    x: {ansible_host: 127.0.0.5}\n")
    cache = tmp_path.parent / f"{tmp_path.name}-cache" / "ssh-g.json"  # not in the config's folder: it counts
    monkeypatch.setenv("SGLFLEET_SSH_CACHE", str(cache))

    def port() -> int:
        ssh_resolve._cache.clear()  # a new command: only the disk remembers
        return load_inventory(inv, ssh_config_path=str(cfg)).select("all")[0].port

    assert port() == 2201 and cache.exists()
    real = ssh_resolve._ssh_g
    monkeypatch.setattr(ssh_resolve, "_ssh_g", lambda *a: pytest.fail("ssh -G ran for an answer kept on disk"))
    assert port() == 2201
    monkeypatch.setattr(ssh_resolve, "_ssh_g", real)
    included.write_text("Host 127.0.0.5\n    Port 2202\n")
    os.utime(included, (time.time() + 5, time.time() + 5))
    assert port() == 2202  # an included file changed
    (tmp_path / "conf.d" / "10-first.conf").write_text("Host 127.0.0.5\n    Port 2203\n")
    os.utime(tmp_path / "conf.d", (time.time() + 10, time.time() + 10))
    assert port() == 2203  # a new file the Include glob matches, read first


def test_under_the_guard_ssh_g_never_canonicalizes_a_name(tmp_path, monkeypatch):
    """CanonicalizeHostname would have ssh -G look names up in DNS; the guard allows /etc/hosts only."""
    cfg, inv = _files(tmp_path, "CanonicalizeHostname always\nCanonicalDomains example.invalid\n"
                                "Host *.example.invalid\n    Port 2999\n",
                      "all:\n  hosts:\n    web1: {}\n")
    from orchestrator.fleet import ssh_resolve

    monkeypatch.setenv("SGLFLEET_SSH_CACHE", "none")
    logs = []
    real = ssh_resolve._parse_log
    monkeypatch.setattr(ssh_resolve, "_parse_log", lambda stderr, *a: logs.append(stderr) or real(stderr, *a))
    (host,) = load_inventory(inv, ssh_config_path=str(cfg)).select("all")
    assert (host.address, host.port) == ("web1", 22) and len(logs) == 1
    assert "resolve_canonicalize" not in logs[0] and "lookup" not in logs[0]  # ssh's own log: no lookup


def test_sglfleet_proxy_jump_naming_an_inventory_host_goes_through_it_as_the_inventory_has_it(tmp_path):
    cfg, inv = _files(tmp_path, "", "all:\n  hosts:\n    gw: {ansible_host: 127.0.0.9, ansible_port: 2209, "
                                    "ansible_user: gate}\n    web: {ansible_host: 127.0.0.10, sglfleet_proxy_jump: gw}\n")
    done = sglfleet("hosts", "-i", str(inv), "web", "--json", env={"SGLFLEET_SSH_CONFIG": str(cfg)})
    (hop,) = json.loads(done.stdout)["hosts"][0]["ssh"]["via"]
    assert (hop["address"]["value"], hop["port"]["value"], hop["user"]["value"]) == ("127.0.0.9", 2209, "gate")
    assert "gate@127.0.0.9:2209" in sglfleet("hosts", "-i", str(inv), "web", env={"SGLFLEET_SSH_CONFIG": str(cfg)}).stdout
