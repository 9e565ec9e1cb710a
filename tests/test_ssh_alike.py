"""One `ssh -G` for many destinations (fleet/ssh_alike.py): every answer derived for a destination
must be what `ssh -G` itself prints for it. Real ssh (openssh-client), no connection."""

from __future__ import annotations

import shutil
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from orchestrator.fleet import ssh_alike, ssh_resolve
from orchestrator.fleet.inventory import load_inventory
from orchestrator.fleet.ssh_resolve import Request, SshConfigFiles

from .test_ssh_config_differential import CORPUS, case_dir  # noqa: F401  (case_dir: the fixture)

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="openssh-client is not installed")

# Configs written to make classes, and to make a wrong class show: a literal HostName under a
# wildcard (the asked member may be the one it names), HostName templates, Match host after and
# before a HostName, an Include only some hosts read, negations, ? and case in patterns.
ALIKE_CONFIGS = [
    ("literal-hostname-under-wildcard", """
        Host h*
            Hostname h5
            Port 2205
        Host *
            User everyone
        """),
    ("hostname-template", """
        Host web*
            Hostname %h.lab.example
        Match host web1.lab.example
            Port 2001
        Host db*
            Hostname %h
        Match host db1
            Port 2002
        """),
    ("match-host-before-hostname", """
        Match host gpu-1,gpu-3
            User early
        Host gpu-*
            Hostname 127.0.0.90
        Match host 127.0.0.90
            IdentityFile ~/.ssh/gpu_%h
        """),
    ("include-in-a-block", """
        Host gpu-*
            Include {dir}/gpu.conf
        Host *
            ConnectTimeout 7
        """),
    ("negation-and-wildcards", """
        Host 10.0.0.? !10.0.0.2
            User rack0
        Host 10.0.*.* !10.0.1.*
            ProxyJump bastion
        Host bastion
            Hostname 127.0.0.9
        Host WEB*
            Port 2300
        Match originalhost web2 user deploy
            Port 2400
        """),
]
GPU_CONF = "Host gpu-2\n    Port 2222\nHost gpu-*\n    IdentityFile ~/.ssh/gpu_key\n"
DESTINATIONS = ["web1", "web2", "web3", "web10", "web-a", "db1", "db2", "db3", "db4", "h1", "h5", "h6", "h7", "x", "a",
                "b", "t", "bastion", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "10.0.0.1", "10.0.0.2", "10.0.0.3",
                "10.0.1.7", "10.0.1.8", "10.0.2.9", "10.0.2.10", "127.0.0.21", "inc1", "inc2", "abs1", "cond1"]
OPTIONS = [("-o", "Port=2200"), ("-o", 'User="deploy"')]  # a port given to ssh (it wins), the Match user deploy


def _derived_answers(cfg, monkeypatch) -> dict:
    """What _answer_alike derives (without asking ssh) for every destination x option set under
    `cfg`: request -> its answer."""
    monkeypatch.setenv("SGLFLEET_SSH_CACHE", "none")
    ssh_resolve._cache.clear()
    files = SshConfigFiles(str(cfg), str(cfg))
    requests = [Request(d, o, files) for o in OPTIONS for d in DESTINATIONS]
    asked = set()
    real = ssh_resolve._ask_quietly
    monkeypatch.setattr(ssh_resolve, "_ask_quietly", lambda r, m: asked.add(r) or real(r, m))
    try:
        with ThreadPoolExecutor(8) as pool:
            ssh_resolve._answer_alike(requests, True, pool)
        return {r: ssh_resolve._alike_answers[ssh_resolve._argv_key(r, True)] for r in requests
                if r not in asked and ssh_resolve._argv_key(r, True) in ssh_resolve._alike_answers}
    finally:
        monkeypatch.setattr(ssh_resolve, "_ask_quietly", real)
        ssh_resolve._alike_answers.clear()
        ssh_resolve._keys.clear()


@pytest.mark.parametrize("name,config", [(n, c) for n, c, _ in CORPUS] + ALIKE_CONFIGS,
                         ids=[c[0] for c in CORPUS] + [c[0] for c in ALIKE_CONFIGS])
def test_every_derived_answer_is_what_ssh_g_prints(case_dir, monkeypatch, name, config):  # noqa: F811
    directory, inc = case_dir
    (directory / "gpu.conf").write_text(GPU_CONF)
    cfg = directory / "ssh_config"
    cfg.write_text(textwrap.dedent(config).replace("{inc}", inc).replace("{dir}", str(directory)))
    answers = _derived_answers(cfg, monkeypatch)
    for request, run in answers.items():
        argv = ssh_resolve._ssh_g_argv(request.destination, request.options, request.files)
        try:
            truth = ssh_resolve._ssh_g(argv, request.destination, request.files, True)
        except Exception as exc:  # ssh refuses it: nothing may have been derived for it
            pytest.fail(f"{name}: an answer was derived for {request.destination} {request.options}, "
                        f"which ssh refuses: {exc}")
        for key in ssh_resolve._DiskCache.KEYS:
            assert run.values.get(key) == truth.values.get(key), (name, request.destination, request.options, key)
        assert (run.files_read, run.segments) == (truth.files_read, truth.segments), (name, request.destination)


def test_classes_are_used_where_they_hold(case_dir, monkeypatch):  # noqa: F811
    """The check above is not empty: these configs do give classes, and the ambiguous ones none."""
    directory, _ = case_dir
    (directory / "gpu.conf").write_text(GPU_CONF)
    counts = {}
    for name, config in ALIKE_CONFIGS:
        cfg = directory / f"{name}.conf"
        cfg.write_text(textwrap.dedent(config).replace("{dir}", str(directory)))
        answers = _derived_answers(cfg, monkeypatch)
        counts[name] = {r.destination for r in answers}
    # web hosts behind a %h.lab template are never derived (their hostname is neither one value
    # nor the destination); db hosts behind exactly %h are (db2 and db3 asked, db4 follows)
    assert counts["hostname-template"].isdisjoint({"web1", "web2", "web3", "web10", "web-a"})
    assert "db4" in counts["hostname-template"] and "db1" not in counts["hostname-template"]
    # h1 and h5 asked (both say hostname h5: a literal), h6 and h7 follow with it
    assert {"h6", "h7"} <= counts["literal-hostname-under-wildcard"]
    assert sum(len(v) for v in counts.values()) >= 20


def test_a_fleet_resolves_the_same_with_classes_as_host_by_host(tmp_path, monkeypatch):
    """End to end: 120 hosts of a rack-style config, through select(), with and without classes."""
    (tmp_path / "conf.d").mkdir()
    for rack in range(4):
        (tmp_path / "conf.d" / f"rack{rack}.conf").write_text(
            f"Host 10.0.{rack}.*\n    {'ProxyJump bastion' if rack % 2 else f'Port 22{rack:02d}'}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {tmp_path}/conf.d/*.conf\nHost bastion\n    Hostname 127.0.0.2\n    User jumper\n"
                   "Match user deploy\n    IdentityFile ~/.ssh/deploy_%r\nHost *\n    ConnectTimeout 5\n")
    lines = ["all:", "  hosts:"] + [f"    h{i}: {{ansible_host: 10.0.{i % 4}.{i // 4 + 1}"
                                      f"{', ansible_user: deploy' if i % 5 == 0 else ''}}}" for i in range(120)]
    (tmp_path / "inv.yaml").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("SGLFLEET_SSH_CACHE", "none")

    def select():
        ssh_resolve._cache.clear()
        ran = []
        real = ssh_resolve._ssh_g
        monkeypatch.setattr(ssh_resolve, "_ssh_g", lambda *a: ran.append(a[1]) or real(*a))
        hosts = load_inventory(tmp_path / "inv.yaml", ssh_config_path=str(cfg)).select("all")
        monkeypatch.setattr(ssh_resolve, "_ssh_g", real)
        return [(h.name, h.address, h.port, h.user, h.identity_files, h.ssh.hops(), h.ssh.sources) for h in hosts], ran

    shared, asked = select()
    monkeypatch.setattr(ssh_resolve, "_ALIKE_MIN", 10 ** 9)  # every host on its own
    alone, asked_alone = select()
    assert shared == alone
    # 120 hosts and the bastion (hosts resolved at once may each ask for the same hop); 8 classes x 2,
    # each option set's first member, the bastion
    assert len(asked_alone) >= 121 and len(asked) < 40, asked


@pytest.mark.parametrize("config", [
    'Match exec "test %h = web1"\n    User x\n', "Match tagged foo\n    User x\n", "Match localnetwork 10.0.0.0/8\n",
    "Include ~/.ssh/%h.conf\n", 'Host "web 1"\n    User x\n', "Include ${HOME}/x.conf\n",
])
def test_configs_this_reading_cannot_vouch_for_give_no_class(config):
    assert ssh_alike.config_patterns([config]) is None


def test_patterns_match_as_openssh_matches_them():
    patterns = ssh_alike.config_patterns(["Host web? !web9 10.0.*\n", "Match host DB*,gpu-[1] user deploy\n"])
    sig = {d: ssh_alike.signature(d, patterns) for d in ("web1", "web9", "web10", "10.0.3.4", "10x0", "db1", "gpu-1")}
    assert sig["web1"] != sig["web10"] and sig["web1"] != sig["web9"]
    assert sig["10.0.3.4"] != sig["10x0"]  # the dot is a dot, not any character
    assert sig["db1"] != sig["web1"]  # Match host lowercases its patterns: DB* matches db1
    assert sig["gpu-1"] == ssh_alike.signature("x", patterns)  # [ ] is no class in OpenSSH: no match
    assert not ssh_alike.plain("Web1") and not ssh_alike.plain("user@h") and not ssh_alike.plain("h:22")
    assert ssh_alike.plain("10.0.0.1") and ssh_alike.plain("gpu-1.lab")


def test_two_answers_tell_how_the_hostname_follows():
    def values(host, hostname, port="22"):
        return {"host": [host], "hostname": [hostname], "port": [port], "canonicalizehostname": ["false"]}

    keys = ("host", "hostname", "port")
    assert ssh_alike.alike("a", values("a", "real"), "b", values("b", "real"), keys) == "same"
    assert ssh_alike.alike("a", values("a", "a"), "b", values("b", "b"), keys) == "destination"
    assert ssh_alike.alike("a", values("a", "a.lab"), "b", values("b", "b.lab"), keys) is None  # a template
    assert ssh_alike.alike("a", values("a", "a"), "b", values("b", "a"), keys) == "same"  # HostName a, for all
    assert ssh_alike.alike("a", values("a", "b"), "b", values("b", "a"), keys) is None
    assert ssh_alike.alike("a", values("a", "x", "1"), "b", values("b", "x", "2"), keys) is None
    on = dict(values("b", "x"), canonicalizehostname=["yes"])
    assert ssh_alike.alike("a", values("a", "x"), "b", on, keys) is None
    assert ssh_alike.answer_for("c", values("a", "a"), "destination") == values("c", "c")
    assert ssh_alike.answer_for("c", values("a", "real"), "same") == values("c", "real")
