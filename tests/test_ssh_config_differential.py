"""sglfleet against OpenSSH itself, on a corpus of ssh configs people really have.

For every case of CORPUS (a config, an inventory's hosts) sglfleet loads the inventory with the
config and selects the hosts; what it would connect with (address, port, user, identity files in
order, each ProxyJump hop's address, port, user and keys, the ProxyCommand it would run) must equal
what the real ssh client (openssh-client) does for the same destination with the options Ansible's
ssh plugin passes for the host's vars (-o Port, -o IdentityFile, -o User, -o ConnectTimeout, then
ansible_ssh_common_args and _extra_args, in that order; the oracle builds them itself):

- address, port, user, ProxyJump, ProxyCommand: `ssh -G`;
- identity files as ssh expands them (tokens %d %h %i %L %l %n %p %r %u %%, ${ENV}, ~, relative
  paths): `ssh -v -o ProxyCommand=/bin/true DEST true`, whose "identity file" lines are the files
  ssh loads once its proxy has started (the proxy is /bin/true, so ssh never reaches a network;
  being the first ProxyCommand it wins over the config's ProxyJump, so cases whose tokens need
  %j or %C keep to hosts without one);
- each hop: the implicit ProxyCommand ssh derives from ProxyJump (`ssh [-l U] [-p P] [-J rest] [-F
  cfg] -W '[%h]:%p' HOP`, from `ssh -G -v`), resolved again by the same oracle;
- the ProxyCommand as ssh runs it: `ssh -v DEST true` with the config's ProxyCommand (in this corpus
  always /bin/true with arguments, so running it reaches nothing) logs "Executing proxy command".

Configs ssh refuses (an unknown keyword, a bad port) must be refused by sglfleet too, naming the
config file. No connection is made by these tests: every ProxyCommand that runs is /bin/true.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import load_inventory

SSH = shutil.which("ssh")
pytestmark = pytest.mark.skipif(SSH is None, reason="openssh-client is not installed (make setup installs it)")

# (name, ssh config, inventory hosts {name: vars}); "{inc}" is a folder under ~/.ssh the test makes
# (relative Include paths are read from ~/.ssh, as ssh reads them), "{dir}" the case's own folder.
CORPUS: list[tuple[str, str, dict]] = [
    ("bastion-own-block", """
        Host bastion
            Hostname 127.0.0.9
            User jumper
            Port 2222
            IdentityFile ~/.ssh/bastion_key
        Host web1
            Hostname 127.0.0.21
            ProxyJump bastion
        """, {"web1": {}}),
    ("bastion-target-key-and-user", """
        Host web*
            ProxyJump bastion
            User deploy
            IdentityFile ~/.ssh/web_key
        Host bastion
            Hostname 127.0.0.9
        """, {"web2": {"ansible_port": 2200}}),
    ("multi-hop", """
        Host a
            Hostname 127.0.0.11
            User ua
            Port 2201
        Host b
            Hostname 127.0.0.12
            User ub
            IdentityFile ~/.ssh/b_key
        Host t
            Hostname 127.0.0.13
            ProxyJump a,b
        """, {"t": {}}),
    ("multi-hop-users-ports-in-spec", """
        Host t
            ProxyJump alice@127.0.0.31:2022,bob@127.0.0.32:2023
        """, {"t": {"ansible_host": "127.0.0.33"}}),
    ("hop-with-own-proxyjump", """
        Host inner
            Hostname 127.0.0.41
            ProxyJump outer
        Host outer
            Hostname 127.0.0.42
            Port 2042
        Host target
            Hostname 127.0.0.43
            ProxyJump inner
        """, {"target": {}}),
    ("proxyjump-ssh-uri", """
        Host t
            Hostname 127.0.0.50
            ProxyJump ssh://carol@127.0.0.51:2051
        """, {"t": {}}),
    ("proxyjump-none-wins", """
        Host direct
            ProxyJump none
        Host jumpy
            Hostname 127.0.0.60
            ProxyJump none
        Host *
            ProxyJump jumpy
        """, {"direct": {"ansible_host": "127.0.0.61"}, "other": {"ansible_host": "127.0.0.62"}}),
    ("proxyjump-first-wins-over-proxycommand", """
        Host t
            ProxyJump 127.0.0.70
            ProxyCommand /bin/true %h
        """, {"t": {}}),
    ("proxycommand-first-wins-over-proxyjump", """
        Host t
            ProxyCommand /bin/true --to %h:%p
            ProxyJump 127.0.0.70
        """, {"t": {"ansible_host": "127.0.0.71"}}),
    ("proxycommand-tokens", """
        Host pc
            Hostname 127.0.0.80
            User puser
            Port 2080
            ProxyCommand /bin/true host=%h port=%p user=%r name=%n pct=%%
        """, {"pc": {}}),
    ("proxycommand-none", """
        Host pc
            ProxyCommand none
        Host *
            ProxyCommand /bin/true never
        """, {"pc": {"ansible_host": "127.0.0.81"}}),
    ("proxycommand-trailing-comment-is-shell-text", """
        Host pc
            ProxyCommand /bin/true %h  # a comment ssh keeps, the shell drops
        """, {"pc": {"ansible_host": "127.0.0.82"}}),
    ("include-relative-glob", """
        Include {inc}/conf.d/*.conf
        Host *
            User fallback
        """, {"inc1": {}, "inc2": {}}),
    ("include-absolute", """
        Include {dir}/extra.conf
        """, {"abs1": {}}),
    ("include-inside-host-block", """
        Host cond*
            Include {dir}/extra.conf
        """, {"cond1": {}, "abs1": {}}),
    ("match-user", """
        Match user bob
            Port 2301
        Host *
            Hostname 127.0.0.90
        """, {"m1": {"ansible_user": "bob"}, "m2": {"ansible_user": "alice"}}),
    ("match-host-after-hostname-token", """
        Host short*
            Hostname %h.lab.internal
        Match host *.lab.internal
            User labuser
            Port 2302
        """, {"short1": {}}),
    ("match-originalhost", """
        Host alias
            Hostname 127.0.0.91
        Match originalhost alias
            User orig
        Match host alias
            Port 9
        """, {"alias": {}}),
    ("match-localuser-and-all", """
        Match localuser nobody-here
            Port 1111
        Match all
            User everyone
        """, {"any1": {"ansible_host": "127.0.0.92"}}),
    ("match-negated-host", """
        Match !host 127.0.0.93
            User notthat
        """, {"n1": {"ansible_host": "127.0.0.93"}, "n2": {"ansible_host": "127.0.0.94"}}),
    ("match-exec", """
        Match exec "true"
            User fromexec
        Match exec "false"
            Port 2999
        """, {"e1": {"ansible_host": "127.0.0.95"}}),
    ("identityfile-tokens-r-p-n-L-h", """
        Host tok
            Hostname 127.0.0.100
            User tuser
            Port 2100
            IdentityFile ~/.ssh/%r_%p_%n_%L_%h
        """, {"tok": {}}),
    ("identityfile-tokens-d-u-i-l-percent", """
        Host tok2
            IdentityFile %d/keys/%u-%i-%l-%%
        """, {"tok2": {"ansible_host": "127.0.0.101"}}),
    ("identityfile-token-C-k-alias", """
        Host tok3
            HostKeyAlias aliased
            IdentityFile /keys/%C-%k
        """, {"tok3": {"ansible_host": "127.0.0.102"}}),
    ("identityfile-env", """
        Host envk
            IdentityFile ${HOME}/.ssh/env_key
        """, {"envk": {"ansible_host": "127.0.0.103"}}),
    ("identityfile-relative", """
        Host rel
            IdentityFile keys/rel_key
        """, {"rel": {"ansible_host": "127.0.0.104"}}),
    ("identityfile-accumulates-inventory-first", """
        Host acc
            IdentityFile ~/.ssh/one
        Host *
            IdentityFile ~/.ssh/two
        """, {"acc": {"ansible_host": "127.0.0.105", "ansible_ssh_private_key_file": "/keys/inventory_key"}}),
    ("identityfile-user-token-follows-ansible-user", """
        Host *
            IdentityFile ~/.ssh/%r.key
        """, {"u1": {"ansible_host": "127.0.0.106", "ansible_user": "deployer"}}),
    ("identitiesonly", """
        Host io
            IdentitiesOnly yes
            IdentityFile ~/.ssh/only
        """, {"io": {"ansible_host": "127.0.0.107"}}),
    ("quoted-identityfile-with-space", """
        Host q
            IdentityFile "/keys/with space/k"
        """, {"q": {"ansible_host": "127.0.0.108"}}),
    ("trailing-comments", """
        Host tc   # the test cluster
            Hostname 127.0.0.110  # its address
            Port 2110 # ssh
            User tcu # user
        """, {"tc": {}}),
    ("equals-syntax-and-case", """
        HOST eq
            HOSTNAME=127.0.0.111
            port=2111
            User = equser
        """, {"eq": {}}),
    ("first-value-wins", """
        Host fw
            Port 2121
        Host fw
            Port 2122
            User first
        Host *
            User second
        """, {"fw": {"ansible_host": "fw"}}),
    ("ansible-host-with-hostname-block", """
        Host 10.1.2.3
            Hostname 127.0.0.120
            Port 2120
        """, {"ct129": {"ansible_host": "10.1.2.3"}}),
    ("ansible-host-name-block-not-used", """
        Host ct130
            Hostname 127.0.0.121
        """, {"ct130": {"ansible_host": "127.0.0.122"}}),
    ("ansible-port-user-win-over-config", """
        Host win
            Hostname 127.0.0.123
            Port 2123
            User cfguser
        """, {"win": {"ansible_port": 2200, "ansible_user": "invuser"}}),
    ("ansible-port-wins-over-common-args-port", """
        Host *
            Hostname 127.0.0.124
        """, {"ap": {"ansible_port": 2201, "ansible_ssh_common_args": "-o Port=2999 -o User=argsuser"}}),
    ("common-args-jump", """
        Host jumpbox
            Hostname 127.0.0.125
            User jb
        """, {"cj": {"ansible_host": "127.0.0.126", "ansible_ssh_common_args": "-J jumpbox"}}),
    ("extra-args-proxyjump-and-identity", """
        Host *
            User cfg
        """, {"ex": {"ansible_host": "127.0.0.127",
                     "ansible_ssh_extra_args": "-o ProxyJump=root@127.0.0.128:2128 -i /keys/extra"}}),
    ("common-args-proxycommand", """
        Host *
            Port 2130
        """, {"cp": {"ansible_host": "127.0.0.130",
                     "ansible_ssh_common_args": "-o ProxyCommand='/bin/true via %h %p'"}}),
    ("hostname-token-and-uppercase-name", """
        Host UP*
            Hostname %h.example.internal
        """, {"UPPER1": {}}),
    ("host-negation-and-lists", """
        Host *.lab !db.lab other
            User labby
        """, {"web.lab": {}, "db.lab": {}, "other": {}}),
    ("ipv6-destination-and-hop", """
        Host six
            Hostname ::1
            ProxyJump [::1]:2222
        """, {"six": {}}),
    ("connect-timeout-and-no-config-values", """
        Host *
            ConnectTimeout 7
        """, {"ct": {"ansible_host": "127.0.0.140"}}),
    ("empty-config", "", {"plain": {"ansible_host": "127.0.0.141", "ansible_port": 2141}}),
]

# ssh refuses these; so must sglfleet, naming the config file
# (name, config, the destination `ssh -G` refuses, or None where ssh refuses only when it connects)
REFUSED: list[tuple[str, str, str | None]] = [
    ("unknown-keyword", "Host *\n    Hostnme 127.0.0.1\n", "127.0.0.160"),
    ("bad-port", "Host *\n    Port twenty\n", "127.0.0.160"),
    ("unknown-token", "Host *\n    IdentityFile ~/.ssh/%z\n", None),  # -G prints it unexpanded
    ("proxyjump-loop", "Host *\n    ProxyJump a\n", "a"),  # the hop a jumps through itself
    ("bad-proxyjump", "Host *\n    ProxyJump user@\n", "127.0.0.160"),
]

EXTRA_CONF = """
Host abs*
    Hostname 127.0.0.150
    Port 2150
Host cond*
    User conditional
"""
INCLUDED = {"10-inc1.conf": "Host inc1\n    Hostname 127.0.0.151\n    IdentityFile ~/.ssh/inc1\n",
            "20-inc2.conf": "Host inc2\n    Hostname 127.0.0.152\n    Port 2152\n"}


@pytest.fixture
def case_dir(tmp_path):
    """The case's folder, a folder under ~/.ssh for relative Includes (removed after), cwd there."""
    ssh_dir = Path(os.path.expanduser("~/.ssh"))
    # ours to remove after if absent or holding only other cases' folders (another worker's)
    # (a user's own ~/.ssh, even an empty one, stays)
    entries = [p.name for p in ssh_dir.iterdir()] if ssh_dir.exists() else None
    made_ssh_dir = entries is None or (entries != [] and all(n.startswith("sglfleet-diff-") for n in entries))
    inc = ssh_dir / f"sglfleet-diff-{os.getpid()}-{tmp_path.name}"
    (inc / "conf.d").mkdir(parents=True)
    for name, text in INCLUDED.items():
        (inc / "conf.d" / name).write_text(text)
    (tmp_path / "extra.conf").write_text(EXTRA_CONF)
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path, inc.name
    finally:
        os.chdir(old)
        shutil.rmtree(inc)
        if made_ssh_dir:
            # Only if empty: test_ssh_alike uses this fixture in another xdist worker, whose case
            # folder may be in it now (a whole-tree removal here wiped it: CI at 8cba893); the
            # last one out removes it.
            try:
                ssh_dir.rmdir()
            except OSError:
                pass


def _write_case(directory: Path, inc: str, config: str, hosts: dict) -> tuple[Path, Path]:
    cfg = directory / "ssh_config"
    cfg.write_text(textwrap.dedent(config).replace("{inc}", inc).replace("{dir}", str(directory)))
    inv = directory / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": hosts}}, sort_keys=False))
    return cfg, inv


# ---------------------------------------------------------------- the oracle: ssh itself


def _ssh(args: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([SSH, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def ansible_args(vars_: dict) -> list[str]:
    """The options ansible's ssh plugin puts on ssh's command line for these vars, in its order."""
    args = []
    if "ansible_port" in vars_:
        args += ["-o", f"Port={vars_['ansible_port']}"]
    if "ansible_ssh_private_key_file" in vars_:
        args += ["-o", f'IdentityFile="{os.path.expanduser(vars_["ansible_ssh_private_key_file"])}"']
    if "ansible_user" in vars_:
        args += ["-o", f'User="{vars_["ansible_user"]}"']
    if "ansible_timeout" in vars_:
        args += ["-o", f"ConnectTimeout={vars_['ansible_timeout']}"]
    for var in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        if var in vars_:
            args += shlex.split(vars_[var])
    return args


def oracle(cfg: Path, destination: str, args: list[str]) -> dict:
    """What ssh does for `ssh -F cfg ARGS destination`: its -G answer, the identity files it loads,
    its hops (each resolved the same way) and the ProxyCommand it runs."""
    g = _ssh(["-G", "-v", "-F", str(cfg), *args, destination])
    assert g.returncode == 0, g.stderr
    values: dict[str, list[str]] = {}
    for line in g.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key, []).append(value)
    # ssh refuses -J with a ProxyCommand; the jump changes only %j and %C, which this corpus
    # uses on hosts without one
    no_jump = [a for i, a in enumerate(args) if a != "-J" and not (i and args[i - 1] == "-J")]
    loaded = _ssh(["-v", "-F", str(cfg), "-o", "ProxyCommand=/bin/true", "-o", "BatchMode=yes", *no_jump,
                   destination, "true"])
    identities = []
    for line in loaded.stderr.splitlines():
        m = re.match(r"debug1: identity file (.+) type -?\d+$", line)
        if m and not (identities and m.group(1) == identities[-1] + "-cert"):
            identities.append(os.path.abspath(m.group(1)))
    result = {"address": values["hostname"][0], "port": int(values["port"][0]), "user": values["user"][0],
              "identity_files": identities, "hops": [], "proxy_command": None}
    implicit = re.search(r"Setting implicit ProxyCommand from ProxyJump: (.+)$", g.stderr, re.M)
    if implicit:
        words = [w for w in shlex.split(implicit.group(1))[1:] if not re.fullmatch(r"-v+", w)]
        w = words.index("-W")
        hop_args, hop = words[:w] + words[w + 2:-1], words[-1]
        hop_args = [a for i, a in enumerate(hop_args) if not (a == "-F" or (i and hop_args[i - 1] == "-F"))]
        inner = oracle(cfg, hop, hop_args)
        result["hops"] = inner["hops"] + [{k: inner[k] for k in ("address", "port", "user", "identity_files")}]
        result["proxy_command"] = inner["proxy_command"]
    elif "proxycommand" in values and values["proxycommand"][0] != "none":
        ran = _ssh(["-v", "-F", str(cfg), "-o", "BatchMode=yes", *args, destination, "true"])
        m = re.search(r"debug1: Executing proxy command: exec (.+)$", ran.stderr, re.M)
        assert m, ran.stderr
        result["proxy_command"] = m.group(1)
    return result


def ours(host) -> dict:
    hops = host.ssh.hops()
    first = hops[0] if hops else host.ssh
    return {"address": host.address, "port": host.port, "user": host.user,
            "identity_files": list(host.identity_files),
            "hops": [{"address": h.address, "port": h.port, "user": h.user, "identity_files": list(h.identity_files)}
                     for h in hops],
            "proxy_command": first.proxy_command}


@pytest.mark.parametrize("name,config,hosts", CORPUS, ids=[c[0] for c in CORPUS])
def test_resolution_equals_openssh(case_dir, monkeypatch, name, config, hosts):
    directory, inc = case_dir
    monkeypatch.delenv("SGLFLEET_SSH_CONFIG", raising=False)
    cfg, inv_path = _write_case(directory, inc, config, hosts)
    selected = load_inventory(inv_path, ssh_config_path=str(cfg)).select("all")
    assert [h.name for h in selected] == list(hosts)
    for host in selected:
        vars_ = hosts[host.name]
        want = oracle(cfg, str(vars_.get("ansible_host", host.name)), ansible_args(vars_))
        assert ours(host) == want, f"{name}: {host.name}"


NO_CONFIG_HOSTS = {"UPPER.Example.COM": {}, "web1": {"ansible_host": "127.0.0.170", "ansible_port": 2170,
                                                     "ansible_user": "deploy"},
                   "keyed": {"ansible_host": "127.0.0.171", "ansible_ssh_private_key_file": "~/.ssh/k",
                             "ansible_timeout": 4},
                   "jumped": {"ansible_host": "127.0.0.172", "ansible_ssh_common_args": "-J 127.0.0.173:2173"}}


def test_no_config_equals_openssh_with_f_none(case_dir):
    """With no ssh config (a path that does not exist; ssh -F none) sglfleet answers most hosts from
    one template `ssh -G`; the answers must still be ssh's."""
    directory, _ = case_dir
    inv_path = directory / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({"all": {"hosts": NO_CONFIG_HOSTS}}, sort_keys=False))
    for host in load_inventory(inv_path, ssh_config_path=str(directory / "missing")).select("all"):
        vars_ = NO_CONFIG_HOSTS[host.name]
        want = oracle(Path("none"), str(vars_.get("ansible_host", host.name)), ansible_args(vars_))
        assert ours(host) == want, host.name


def test_corpus_is_large_enough():
    assert len(CORPUS) + len(REFUSED) >= 40


@pytest.mark.parametrize("name,config,refused", REFUSED, ids=[c[0] for c in REFUSED])
def test_configs_ssh_refuses_are_refused_naming_the_file(case_dir, name, config, refused):
    directory, inc = case_dir
    cfg, inv_path = _write_case(directory, inc, config, {"h1": {"ansible_host": "127.0.0.160"}})
    if refused is not None:
        assert _ssh(["-G", "-F", str(cfg), refused]).returncode != 0
    inventory = load_inventory(inv_path, ssh_config_path=str(cfg))
    with pytest.raises(ConfigError) as info:
        inventory.select("all")
    assert str(cfg) in str(info.value)
