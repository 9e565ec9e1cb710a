"""Inventory loading, variable precedence, ssh_config, patterns, and file:line errors.

The same behaviour is checked against ansible-core itself in test_ansible_differential.py; these
tests need no Ansible and run everywhere."""

from __future__ import annotations

import json
import pwd
import os
import socket
import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import load_inventory

from .conftest import ROOT, sglfleet

FLEET = """\
all:
  vars:
    ansible_user: deploy
    ansible_python_interpreter: /usr/bin/python3
  hosts:
    ct129: {ansible_host: 127.0.0.11}
    ct130: {ansible_host: 127.0.0.12, ansible_port: 2222, ansible_user: admin}
    ct131: {ansible_host: 127.0.0.99, ansible_ssh_host: 127.0.0.13}
    db1: {ansible_host: 127.0.0.20}
  children:
    gpu-fleet:
      vars: {sglfleet_models_dir: /data/models}
      hosts: {ct129: , ct130: , ct131: }
      children:
        h200:
          vars: {sglfleet_models_dir: /nvme/models}
          hosts: {ct130: {ansible_python_interpreter: /root/ml-env/bin/python3}}
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
    assert ct131.address == "127.0.0.13"  # Ansible's legacy ansible_ssh_host wins over ansible_host
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
    ("gpu-fleet,lab,!h200", ["ct129", "ct131", "db1"]),
    ("gpu-fleet:lab:!h200", ["ct129", "ct131", "db1"]),
    ("!db1", ["ct129", "ct130", "ct131"]),
    ("~ct13[01]", ["ct130", "ct131"]),
    ("h2*", ["ct130"]),  # globs match group names too
    ("lab,gpu-fleet", ["ct129", "db1", "ct130", "ct131"]),  # Ansible's order: term by term
    ("gpu-fleet[0]", ["ct129"]),
    ("gpu-fleet[-1]", ["ct131"]),  # the group's own hosts first, then its children's
    ("gpu-fleet[1:]", ["ct130", "ct131"]),
])
def test_patterns(fleet, pattern, expected):
    assert names(fleet, pattern) == expected


@pytest.mark.parametrize("pattern,message", [
    ("gpu-flet", "did you mean 'gpu-fleet'"),
    ("ct999", "'ct999' is not a host or group"),
    ("gpu-fleet:&db1", "matches no host"),
    ("", "empty host pattern"),
    # issue 17: what Ansible reads as 'all' (or drops) must never widen or shift a rollout
    (",", "term 1 of 2 is empty"),
    (":", "empty term"),
    ("  ", "empty host pattern"),
    ("gpu-fleet,", "term 2 of 2 is empty"),
    ("gpu-fleet,,lab", "term 2 of 3 is empty"),
    ("gpu-fleet::lab", "empty term"),
    (":gpu-fleet", "empty term"),
    ("gpu-fleet:", "empty term"),
    ("!", "with no name"),
    ("gpu-fleet,!", "term 2 of 2 is empty"),
    ("all:!ct13O", "'ct13O' is not a host or group"),  # a typo in an exclusion would widen it
    ("gpu-fleet:&lab,db1", "splits it on commas only"),
    ("gpu-fleet[7]", "position 7 is out of range"),
    ("gpu-fleet[1-2]", "the [x-y] subscript was removed"),
    ("~ct13(", "bad regex"),
    ("~130", "'~130' is not a host or group"),  # ~regex is anchored at the start, as in Ansible
    ("ct1[29]", "'ct1[29]' is not a host or group"),  # a subscript, not a glob: nothing named 'ct1'
])
def test_pattern_errors(fleet, pattern, message):
    with pytest.raises(ConfigError) as info:
        fleet.select(pattern)
    assert message in str(info.value)


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
            ct130: {ansible_user: inventory-user, ansible_port: 2022}
    """)
    inv = load_inventory(inv_path, ssh_config_path=str(ssh_config))
    ct129, ct130 = inv.select("all")  # selected hosts are resolved by OpenSSH (ssh -G)
    assert (ct129.address, ct129.port, ct129.user, ct129.ssh.proxy_jump) == ("127.0.0.50", 2200, "sshcfg",
                                                                             "bastion")
    assert ct129.identity_files == (str(Path("~/.ssh/ct129_key").expanduser()),)
    assert (ct130.address, ct130.port, ct130.user) == ("127.0.0.60", 2022, "inventory-user")


@pytest.mark.parametrize("text,line,message", [
    ("all:\n  hosts:\n    ct129: {address: [1, 2\n", 4, "invalid YAML"),
    ("all:\n  hosts:\n    ct129:\n      sglfleet_model_dir: /m\n", 4,
     "unknown sglfleet setting 'sglfleet_model_dir' in host 'ct129' (did you mean 'sglfleet_models_dir'?)"),
    ("all:\n  hostz:\n    ct129:\n", 2, "unknown key 'hostz' in group 'all' (did you mean 'hosts'?)"),
    ("all:\n  hosts:\n    ct129:\n      ansible_port: twenty-two\n", 4,
     "'ansible_port' of host 'ct129' must be an integer port number"),
    ("all:\n  vars:\n    sglfleet_host_key_policy: yolo\n  hosts: {a: }\n", 3, "must be one of strict, accept-new"),
    ("all:\n  hosts:\n    ct129:\n      sglfleet_proxy_jump: 'host:abc'\n", 4,
     "'sglfleet_proxy_jump' of host 'ct129' must be [user@]host[:port]; the port 'abc' is not a port number"),
    ("all:\n  hosts:\n    ct129:\n      ansible_host: '{{ inventory_hostname }}.lan'\n", 4, "is a Jinja template"),
    ("all:\n  hosts: ct129\n", 2, "Ansible would invent a host named 'ct129'"),
    ("all:\n  hosts:\n    web[5:1]:\n", 3, "is empty (begin > end)"),
    ("all:\n  hosts:\n    web[01:100]:\n", 3, "same width"),
    ("all:\n  hosts:\n    web[1:3:x]:\n", 3, "step"),
    ("all:\n  children:\n    a:\n      children:\n        b:\n          children:\n            a:\n", 5,
     "group 'b' cannot be a child of 'a': 'b' contains 'a' (a loop)"),
    ("all:\n  vars:\n    ansible_group_priority: high\n  hosts: {a: }\n", 3, "must be an integer"),
    ("plugin: aws_ec2\n", 1, "configuration of Ansible's 'aws_ec2' inventory plugin"),
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


def test_non_utf8_inventory_is_refused_with_its_line(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_bytes(b"all:\n  hosts:\n    caf\xe9:\n")
    with pytest.raises(ConfigError, match=r"inv.yaml:3: the inventory is not UTF-8 text \(byte 0xe9\)"):
        load_inventory(path, ssh_config_path=str(tmp_path / "none"))


@pytest.mark.parametrize("content,line,message", [
    (b"127.0.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK\n", 1, "broken entry"),
    (b"# ok\n127.0.0.2 ssh-rsa AAAA\n", 2, "broken entry"),
    (b"\n\n127.0.0.1 ssh-ed25519 \xff\xfe\n", 3, "not UTF-8"),
])
def test_garbage_known_hosts_is_refused_with_its_line(tmp_path, content, line, message):
    inv = write(tmp_path, "all:\n  hosts:\n    a: {ansible_host: 127.0.0.1}\n")
    (tmp_path / "inv.known_hosts").write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_inventory(inv, ssh_config_path=str(tmp_path / "none"))
    assert str(info.value).startswith(f"{tmp_path / 'inv.known_hosts'}:{line}: ") and message in str(info.value)
    proc = sglfleet("hosts", "all", "-i", str(inv))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"inv.known_hosts:{line}:" in proc.stderr.replace("\n", "")


def test_host_vars_win_over_group_vars_and_deeper_groups_over_shallow(tmp_path):
    # The same var at every level, so that swapping any two levels changes a value below.
    inv = load_inventory(write(tmp_path, """\
        all:
          vars: {role: all, ansible_port: 2000}
          children:
            outer:
              vars: {role: outer, ansible_port: 2001}
              hosts:
                plain:
                own: {role: own-host, ansible_port: 2099}
              children:
                inner:
                  vars: {role: inner, ansible_port: 2002}
                  hosts: {deep: , own: }
            zeta:
              vars: {role: zeta, ansible_group_priority: 0}
              hosts: {both: }
            alpha:
              vars: {role: alpha}
              hosts: {both: }
    """), ssh_config_path=str(tmp_path / "none"))
    assert inv.hosts["own"].vars["role"] == "own-host" and inv.hosts["own"].port == 2099
    assert inv.hosts["deep"].vars["role"] == "inner" and inv.hosts["deep"].port == 2002
    assert inv.hosts["plain"].vars["role"] == "outer" and inv.hosts["plain"].port == 2001
    # same depth: lower ansible_group_priority first, so alpha (priority 1) beats zeta (0) by
    # priority although zeta sorts after alpha by name
    assert inv.hosts["both"].vars["role"] == "alpha"


def test_group_vars_and_host_vars_dirs_as_ansible_reads_them(tmp_path):
    (tmp_path / "group_vars" / "gpu").mkdir(parents=True)
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text("ansible_user: ops\n")
    (tmp_path / "group_vars" / "gpu" / "a.yml").write_text("role: gpu-file-a\nansible_port: 2200\n")
    (tmp_path / "group_vars" / "gpu" / "b.yml").write_text("role: gpu-file-b\n")
    (tmp_path / "host_vars" / "ct130.yaml").write_text("ansible_host: 127.0.0.30\n")
    inv = load_inventory(write(tmp_path, """\
        all:
          children:
            gpu:
              children:
                h200:
                  vars: {role: inventory-deeper-group}
                  hosts:
                    ct129:
                    ct130: {ansible_host: 127.0.0.99}
    """), ssh_config_path=str(tmp_path / "none"))
    ct129, ct130 = inv.hosts["ct129"], inv.hosts["ct130"]
    # group_vars/ files beat every group var of the inventory itself, later files in a dir win
    assert ct129.vars["role"] == "gpu-file-b" and (ct129.user, ct129.port) == ("ops", 2200)
    assert ct130.address == "127.0.0.30"  # host_vars/ beats the inventory's host vars


@pytest.mark.parametrize("name,content,line,message", [
    ("all.yml", "ansible_port: [1]\n", 1, "'ansible_port' of group 'all' (group_vars/) must be an integer"),
    ("all.yml", "- a\n- b\n", 1, "must be a mapping of variables"),
    ("all.yml", "$ANSIBLE_VAULT;1.1;AES256\n6162\n", 1, "encrypted with Ansible Vault"),
])
def test_bad_vars_dir_files_are_refused_with_file_and_line(tmp_path, name, content, line, message):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / name).write_text(content)
    with pytest.raises(ConfigError) as info:
        load_inventory(write(tmp_path, "all:\n  hosts:\n    a:\n"), ssh_config_path=str(tmp_path / "none"))
    assert str(info.value).startswith(f"{tmp_path / 'group_vars' / name}:{line}: ") and message in str(info.value)


def test_ansible_host_syntax(tmp_path):
    inv = load_inventory(write(tmp_path, """\
        all:
          hosts:
            badwolf.example.com:5309:
            localhost: {ansible_connection: local}
            www[01:03:2].example.com:
            db-[a:c]:
          children:
            web:
              hosts:
                app: {port: 8080, user: www-data, address: 0.0.0.0, color: green}
            again:
              hosts:
                app: {ansible_host: 127.0.0.5, color: blue}
                db-a: {color: red}
    """), ssh_config_path=str(tmp_path / "none"))
    assert (inv.hosts["badwolf.example.com"].address, inv.hosts["badwolf.example.com"].port) == \
        ("badwolf.example.com", 5309)
    assert inv.hosts["localhost"].connection == "local"
    assert [h.name for h in inv.select("www*")] == ["www01.example.com", "www03.example.com"]
    assert [h.name for h in inv.select("db-*")] == ["db-a", "db-b", "db-c"]
    app = inv.hosts["app"]
    # plain port/user/address are the application's, not SSH's; the later definition adds ansible_host
    assert (app.address, app.port, app.user) == ("127.0.0.5", 22, pwd.getpwuid(os.getuid()).pw_name)
    assert app.vars["port"] == 8080 and app.vars["color"] == "blue"
    assert [h.name for h in inv.select("ungrouped")] == ["badwolf.example.com", "localhost", "www01.example.com",
                                                         "www03.example.com", "db-b", "db-c"]


def test_implicit_localhost_runs_locally(tmp_path):
    inv = load_inventory(write(tmp_path, "all:\n  vars: {color: green}\n  hosts:\n    a: {ansible_host: 127.0.0.1}\n"),
                         ssh_config_path=str(tmp_path / "none"))
    (local,) = inv.select("localhost")
    assert local.connection == "local" and local.vars["color"] == "green"
    assert [h.name for h in inv.select("all")] == ["a"]  # not part of all, as in Ansible


def test_notes_for_ansible_vars_sglfleet_does_not_use(tmp_path, caplog):
    inv = load_inventory(write(tmp_path, """\
        all:
          hosts:
            a: {ansible_host: 127.0.0.1, ansible_password: pw, ansible_become: true, ansible_ruby_interpreter: /r}
            b: {ansible_host: 127.0.0.2, ansible_ssh_common_args: '-o ProxyJump=jump:2200 -o ProxyCommand=nc -C'}
    """), ssh_config_path=str(tmp_path / "none"))
    _, b = inv.select("all")
    text = "\n".join(inv.notes)
    assert "ansible_password/ansible_ssh_pass not used" in text and "ansible_become* not used" in text
    assert "does not apply -C" in text and "ProxyCommand" not in text.split("does not apply")[1]
    assert "ruby" not in text
    # as ssh takes them: the first of ProxyJump / ProxyCommand wins
    assert (b.ssh.proxy_jump, b.ssh.proxy_command, b.ssh.via.address, b.ssh.via.port) == ("jump:2200", None,
                                                                                          "jump", 2200)


def test_user_vars_are_kept(tmp_path):
    inv = load_inventory(write(tmp_path, "all:\n  hosts:\n    a: {sglfleet_lab_gpu: h200, rack: r7}\n"),
                         ssh_config_path=str(tmp_path / "none"))
    assert inv.hosts["a"].vars["sglfleet_lab_gpu"] == "h200"
    assert inv.hosts["a"].vars["rack"] == "r7"


def test_production_example_is_valid_data():
    inv = load_inventory(ROOT / "inventory" / "production.example.yaml", ssh_config_path="/nonexistent")
    ct129 = inv.hosts["ct129"]
    assert (ct129.address, ct129.user, ct129.port) == ("10.1.230.172", "root", 22)
    assert ct129.python == "/root/ml-env/bin/python3"
    assert ct129.models_dir == "/root/models"
    assert "gpu-fleet" in ct129.groups


def test_cli_config_error_is_one_paragraph_exit_2(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    ct129:\n      sglfleet_model_dir: /m\n")
    proc = sglfleet("hosts", "all", "-i", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{path}:4: unknown sglfleet setting 'sglfleet_model_dir'" in proc.stderr.replace("\n", "")
    proc = sglfleet("hosts", "gpu-flet", "-i", str(ROOT / "inventory" / "production.example.yaml"))
    assert proc.returncode == 2 and "did you mean 'gpu-fleet'" in proc.stderr.replace("\n", "")


@pytest.mark.parametrize("pattern", [",", ":", "all,", "ct129,,ct130", "!", ""])
def test_cli_separator_patterns_exit_2_before_connecting(tmp_path, pattern):
    """Issue 17: `sglfleet run ',' true` ran on every host; now nothing connects."""
    listener, inv = _listening_inventory(tmp_path)
    with listener:
        proc = sglfleet("run", pattern, "true", "-i", str(inv))
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        _assert_no_connection(listener)


def _listening_inventory(tmp_path):
    """An inventory whose two hosts point at a socket of ours: a connection attempt would show."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    inv = write(tmp_path, f"""\
        all:
          vars: {{ansible_host: 127.0.0.1, ansible_port: {port}, ansible_timeout: 2}}
          hosts:
            ct129:
            ct130:
    """)
    return listener, inv


def _assert_no_connection(listener):
    try:
        conn, peer = listener.accept()
    except BlockingIOError:
        return
    conn.close()
    pytest.fail(f"something connected to the hosts' address from {peer}")


def test_cli_hosts_json_lists_selection_without_connecting(tmp_path):
    listener, inv = _listening_inventory(tmp_path)
    with listener:
        proc = sglfleet("hosts", "all", "-i", str(inv), "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert [h["name"] for h in doc["hosts"]] == ["ct129", "ct130"]
        _assert_no_connection(listener)
    proc = sglfleet("hosts", "gpu-fleet", "-i", str(ROOT / "inventory" / "production.example.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr  # a non-loopback host: listing it must not touch it
    assert [h["name"] for h in json.loads(proc.stdout)["hosts"]] == ["ct129"]


def test_ansible_connection_local_runs_here_not_over_ssh(tmp_path):
    listener, _ = _listening_inventory(tmp_path)
    port = listener.getsockname()[1]
    inv = write(tmp_path, f"""\
        all:
          hosts:
            localhost: {{ansible_connection: local, ansible_host: 127.0.0.1, ansible_port: {port}}}
            ct129: {{ansible_host: 127.0.0.1, ansible_port: {port}}}
    """, name="local.yaml")
    with listener:
        for pattern in ("localhost", "127.0.0.1"):  # the second names the same host, as in Ansible
            proc = sglfleet("run", pattern, "echo ran-here-$PPID", "-i", str(inv), "--json")
            assert proc.returncode == 0, proc.stderr
            (result,) = json.loads(proc.stdout)["hosts"].values()
            assert result["value"]["stdout"].startswith("ran-here-")
        _assert_no_connection(listener)  # ct129 (same address and port, over SSH) would have shown here


def test_sglfleet_settings_are_validated_where_written_and_old_names_get_a_note(tmp_path):
    text = ("all:\n  vars:\n    sglfleet_router_url: [http://127.0.0.1:30000, http://127.0.0.2:30000]\n"
            "  hosts:\n    a: {server_bind: 127.0.7.1, sglfleet_server_command: [/usr/bin/sim]}\n")
    inv = load_inventory(write(tmp_path, text), ssh_config_path=str(tmp_path / "none"))
    inv.select("all")
    notes = "\n".join(inv.notes)
    assert "'server_bind' is an ordinary variable" in notes and "sglfleet_server_bind" in notes, notes
    assert inv.hosts["a"].vars["sglfleet_server_command"] == ["/usr/bin/sim"]
    for bad, message in (("sglfleet_server_manager: docker", "must be systemd or supervisor"),
                         ("sglfleet_profile_overrides: [1]", "must map profile names to overrides"),
                         ("sglfleet_router_url: ''", "non-empty string"),
                         ("sglfleet_server_binds: x", "did you mean 'sglfleet_server_bind'")):
        path = write(tmp_path, f"all:\n  hosts:\n    a:\n      {bad}\n", name="bad.yaml")
        with pytest.raises(ConfigError) as info:
            load_inventory(path, ssh_config_path=str(tmp_path / "none"))
        assert f"{path}:4" in str(info.value) and message in str(info.value), str(info.value)


# ---------------------------------------------------------------- INI, directories, @FILE, merge keys
# (each also checked against ansible-core in test_ansible_differential.py)

INI = """\
# an INI inventory without extension
lonely ansible_host=127.0.0.5
[gpu]
ct[129:130] ansible_user=deploy
ct131:2222 ansible_host=127.0.0.13 tags="['a', 'b']" label="two words"
[gpu:vars]
ansible_python_interpreter=/root/ml-env/bin/python3
batch=4
[fleet:children]
gpu
"""


def test_ini_inventory_is_read_as_ansible_reads_it(tmp_path):
    inv = load_inventory(write(tmp_path, INI, "hosts"), ssh_config_path=str(tmp_path / "none"))
    assert list(inv.hosts) == ["lonely", "ct129", "ct130", "ct131"]
    assert names(inv, "fleet") == ["ct129", "ct130", "ct131"] and names(inv, "ungrouped") == ["lonely"]
    ct131 = inv.hosts["ct131"]
    assert (ct131.address, ct131.port, ct131.python) == ("127.0.0.13", 2222, "/root/ml-env/bin/python3")
    assert ct131.vars["tags"] == ["a", "b"] and ct131.vars["label"] == "two words" and ct131.vars["batch"] == 4
    assert inv.hosts["ct129"].user == "deploy" and set(inv.hosts["ct129"].groups) == {"gpu", "fleet"}


@pytest.mark.parametrize("text,line,message", [
    ("[gpu]\nct129 ansible_port=x\n", 2, "'ansible_port' of host 'ct129' must be an integer port number"),
    ("[gpu]\nct129\n[gpu:vars]\nsglfleet_model_dir=/m\n", 4, "unknown sglfleet setting 'sglfleet_model_dir'"),
    ("[gpu]\nct129\n[gpu:childs]\nx\n", 3, "unknown type 'childs'"),
    ("[gpu:children]\nmissing\n[x]\nh\n", 2, "names group 'missing', which is never declared"),
    ("[a:children]\nb\n[b:children]\na\n", 4, "a loop"),
    ("[gpu]\nweb[3:1]\n", 2, "is empty (begin > end)"),
])
def test_bad_ini_reports_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text, "hosts.ini")
    with pytest.raises(ConfigError) as info:
        load_inventory(path, ssh_config_path=str(tmp_path / "none"))
    assert str(info.value).startswith(f"{path}:{line}: ") and message in str(info.value), str(info.value)


def test_other_ansible_inventory_plugins_are_refused_by_name(tmp_path):
    script = write(tmp_path, "#!/bin/sh\necho '{}'\n", "inventory.sh")
    script.chmod(0o755)
    toml = write(tmp_path, "[web.hosts]\n", "hosts.toml")
    for path, words in ((script, "executable inventory script"), (toml, "TOML inventory")):
        with pytest.raises(ConfigError) as info:
            load_inventory(path, ssh_config_path=str(tmp_path / "none"))
        assert str(info.value).startswith(f"{path}:1: ") and words in str(info.value)
    executable_yaml = write(tmp_path, "all:\n  hosts:\n    a:\n", "exec.yaml")  # no #!: Ansible reads it
    executable_yaml.chmod(0o755)
    assert list(load_inventory(executable_yaml, ssh_config_path=str(tmp_path / "none")).hosts) == ["a"]


def test_inventory_directory_skips_what_ansible_skips_and_reads_its_vars_dirs(tmp_path):
    inv_dir = tmp_path / "inventory"
    (inv_dir / "group_vars").mkdir(parents=True)
    write(inv_dir, "[web]\nw1\n", "10-web.ini")
    write(inv_dir, "all:\n  hosts:\n    y1:\n", "20-more.yml")
    for name in ("README.md", "hosts.bak", "10-web.ini~", "x.retry", ".hidden", "ansible.cfg", "n.txt"):
        write(inv_dir, "[web]\nnot-read\n", name)
    write(inv_dir / "group_vars", "color: blue\n", "web.yml")
    inv = load_inventory(inv_dir, ssh_config_path=str(tmp_path / "none"))
    assert list(inv.hosts) == ["w1", "y1"] and inv.hosts["w1"].vars == {"color": "blue"}
    assert inv.known_hosts_path == str(tmp_path / "inventory.known_hosts")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no file Ansible would read"):
        load_inventory(tmp_path / "empty", ssh_config_path=str(tmp_path / "none"))


def test_limit_file_patterns_one_per_line(fleet, tmp_path):
    retry = write(tmp_path, "ct130\n\nlab\n!db1\n", "site.retry")
    assert names(fleet, f"@{retry}") == ["ct129", "ct130"]  # in the order `all` lists them
    assert names(fleet, f"ct131,@{retry}") == ["ct129", "ct130", "ct131"]
    typo = write(tmp_path, "ct130\nct13O\n", "typo.retry")
    with pytest.raises(ConfigError) as info:
        fleet.select(f"@{typo}")
    assert str(info.value).startswith(f"{typo}:2: 'ct13O' is not a host or group")
    empty = write(tmp_path, "\n", "empty.retry")
    with pytest.raises(ConfigError, match="names no host pattern; Ansible would then limit nothing"):
        fleet.select(f"@{empty}")
    with pytest.raises(ConfigError, match="limit file .* not found"):
        fleet.select(f"@{tmp_path / 'missing.retry'}")
    with pytest.raises(ConfigError, match="a limit file is a term of its own"):
        fleet.select(f"ct131,!@{retry}")


def test_yaml_merge_keys_with_explicit_overrides(tmp_path):
    inv = load_inventory(write(tmp_path, """\
        all:
          vars:
            base: &base {ansible_user: deploy, ansible_port: 2200}
          hosts:
            a: {<<: *base, ansible_port: 2201}
            b:
              ansible_port: 2202
              <<: *base
        """), ssh_config_path=str(tmp_path / "none"))
    assert (inv.hosts["a"].user, inv.hosts["a"].port) == ("deploy", 2201)
    assert (inv.hosts["b"].user, inv.hosts["b"].port) == ("deploy", 2202)
    with pytest.raises(ConfigError, match="duplicate key 'ansible_port'"):
        load_inventory(write(tmp_path, "all:\n  hosts:\n    a: {<<: {x: 1}, ansible_port: 1, ansible_port: 2}\n",
                             "dup.yaml"), ssh_config_path=str(tmp_path / "none"))


def test_ansible_inventory_settings_are_the_default_source(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    write(project, "[web]\nw1 ansible_host=127.0.0.1\n", "hosts.ini")
    write(project, "[defaults]\ninventory = ./hosts.ini  ; a comment\n", "ansible.cfg")
    env = {"HOME": str(tmp_path), "ANSIBLE_CONFIG": "", "SGLFLEET_INVENTORY": "", "ANSIBLE_INVENTORY": ""}
    env.pop("ANSIBLE_CONFIG")
    proc = sglfleet("hosts", "all", env={**env, "ANSIBLE_CONFIG": str(project / "ansible.cfg")}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "w1" in proc.stdout
    assert f"inventory: {project / 'hosts.ini'} (chosen by inventory = in {project / 'ansible.cfg'})" in \
        proc.stderr.replace("\n", "")
    write(tmp_path, "all:\n  hosts:\n    e1:\n", "env.yaml")
    proc = sglfleet("hosts", "all", env={**env, "ANSIBLE_INVENTORY": "env.yaml"}, cwd=tmp_path)
    assert proc.returncode == 0 and "e1" in proc.stdout and "(chosen by ANSIBLE_INVENTORY)" in proc.stderr
