"""The SSH transport against real sshd lab hosts."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest

from orchestrator.errors import HostKeyError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

pytestmark = pytest.mark.lab


def test_run_stdout_stderr_exit_code(conn):
    result = conn.run("echo out; echo err >&2; exit 7")
    assert (result.exit_code, result.stdout, result.stderr) == (7, b"out\n", b"err\n")
    assert not result.ok and result.duration > 0
    assert conn.run("true").ok


def test_stdin_is_streamed_to_the_command(conn):
    payload = os.urandom(3 * 1024 * 1024 + 17)
    result = conn.run("sha256sum | cut -d' ' -f1", stdin=payload)
    assert result.stdout.decode().strip() == hashlib.sha256(payload).hexdigest()
    assert result.stdin_bytes == len(payload)


def test_ten_megabytes_of_output_arrive_whole(conn):
    # 10 MiB of random bytes on stdout and 10 MiB on stderr at the same time; the remote
    # side reports the hashes of what it sent, so nothing is compared against itself.
    script = ("head -c 10485760 /dev/urandom > /tmp/big.out; head -c 10485760 /dev/urandom > /tmp/big.err; "
              "sha256sum /tmp/big.out /tmp/big.err >&2; cat /tmp/big.out; cat /tmp/big.err >&2")
    result = conn.run(script)
    assert result.ok
    lines = result.stderr.split(b"\n", 2)
    want_out, want_err = (line.split()[0].decode() for line in lines[:2])
    assert len(result.stdout) == 10 * 1024 * 1024
    assert hashlib.sha256(result.stdout).hexdigest() == want_out
    assert hashlib.sha256(lines[2]).hexdigest() == want_err


def test_timeout_kills_the_remote_command_tree(conn):
    started = time.monotonic()
    result = conn.run("sh -c 'sleep 300 & echo $! > /tmp/child.pid; wait'", timeout=1.0)
    assert result.timed_out and result.exit_code is None and not result.ok
    assert time.monotonic() - started < 15
    pid = conn.run("cat /tmp/child.pid").stdout.decode().strip()
    assert pid.isdigit()
    deadline = time.monotonic() + 5
    while conn.run(f"kill -0 {pid}").exit_code == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert conn.run(f"kill -0 {pid} 2>/dev/null").exit_code != 0, "the backgrounded sleep survived the timeout"


def test_one_connection_is_reused(conn):
    conn.run("true")
    transport = conn.transport
    for _ in range(5):
        conn.run("true")
    assert conn.transport is transport


def test_tree_of_500_files_pushed_in_one_stream(conn, tmp_path):
    src = tmp_path / "tree"
    for i in range(500):
        sub = src / f"d{i % 7}" / f"e{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.bin").write_bytes(os.urandom(i * 37 % 4096))
    (src / "empty.txt").write_bytes(b"")
    opened = []
    real_open_session = conn.transport.open_session

    def counting_open_session(*args, **kwargs):
        opened.append(1)
        return real_open_session(*args, **kwargs)

    conn.transport.open_session = counting_open_session
    try:
        push = conn.put_tree(src, "/tmp/pushed")
    finally:
        conn.transport.open_session = real_open_session
    assert push.result.ok, push.result.stderr_text
    assert len(opened) == 1, "the tree must travel over ONE exec channel"
    assert push.files == 501
    local = sorted(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(src)}"
                   for p in src.rglob("*") if p.is_file())
    remote = conn.run("cd /tmp/pushed && find . -type f -exec sha256sum {} + | sort -k2")
    assert sorted(remote.stdout.decode().splitlines()) == local


def test_changed_host_key_is_refused_with_file_and_line(inventory, tmp_path):
    host = inventory.hosts["ct130"]
    other = inventory.hosts["ct131"]
    # A known_hosts whose line 2 records ct131's key for ct130's address.
    lines = open(inventory.known_hosts_path).read().splitlines()
    by_address = {line.split()[0]: line for line in lines}
    forged = by_address[other.address].replace(other.address, host.address, 1)
    path = tmp_path / "known_hosts"
    path.write_text(by_address[other.address] + "\n" + forged + "\n")
    for policy in ("strict", "accept-new"):
        with pytest.raises(HostKeyError) as info:
            Connection(host, KnownHosts(path), policy).run("true")
        assert "HOST KEY CHANGED" in str(info.value)
        assert f"{path}:2" in str(info.value)
    assert path.read_text().count(host.address) == 1, "a changed key must never be recorded"


def test_unknown_key_strict_refuses_accept_new_records_once(inventory, tmp_path):
    host = inventory.hosts["ct129"]
    path = tmp_path / "known_hosts"
    with pytest.raises(HostKeyError, match="unknown host key"):
        Connection(host, KnownHosts(path), "strict").run("true")
    assert not path.exists()
    with Connection(host, KnownHosts(path), "accept-new") as c:
        assert c.run("true").ok
    recorded = path.read_text()
    assert recorded.startswith(f"{host.address} ssh-ed25519 ") and recorded.count("\n") == 1
    with Connection(host, KnownHosts(path), "strict") as c:  # now known: strict passes
        assert c.run("hostname").stdout == b"ct129\n"
    assert path.read_text() == recorded


def test_unreachable_host_fails_with_clear_error(inventory):
    from dataclasses import replace

    from orchestrator.errors import ConnectError
    nowhere = replace(inventory.select("ct129")[0], address="127.0.9.9")
    with pytest.raises(ConnectError, match=r"cannot connect to root@127\.0\.9\.9:22 after 3 attempts"):
        Connection(nowhere, KnownHosts(inventory.known_hosts_path)).run("true")


def test_proxy_jump_through_another_lab_host(inventory):
    from dataclasses import replace
    target = replace(inventory.hosts["ct130"], proxy_jump="ct129")
    with Connection(target, KnownHosts(inventory.known_hosts_path), jump_host=inventory.hosts["ct129"]) as c:
        assert c.run("hostname").stdout == b"ct130\n"


def test_latency_proxy_adds_delay(inventory, lab):
    from dataclasses import replace

    from orchestrator.fleet.hostkeys import known_hosts_name
    from orchestrator.lab.proxy import LatencyProxy
    (host,) = inventory.select("ct129")
    proxy = LatencyProxy((host.address, 22), delay_ms=100).start()
    try:
        known = KnownHosts(inventory.known_hosts_path + ".proxy")
        shutil.copyfile(inventory.known_hosts_path, known.path)
        pub = (lab.host_dir("ct129") / "ssh_host_ed25519_key.pub").read_text().split()
        with open(known.path, "a") as fh:
            fh.write(f"{known_hosts_name(*proxy.address)} {pub[0]} {pub[1]}\n")
        slow = replace(host, address=proxy.address[0], port=proxy.address[1])
        with Connection(slow, known) as c:
            c.run("true")
            started = time.monotonic()
            assert c.run("hostname").stdout == b"ct129\n"
            # one command is at least one round trip: >= 2 x 100 ms with the proxy
            assert time.monotonic() - started >= 0.2
    finally:
        proxy.stop()


# ---------------------------------------------------------------- reached as OpenSSH would


def _lab_config(tmp_path, lab, text):
    path = tmp_path / "ssh_config"
    path.write_text(text.replace("{key}", str(lab.key_path)))
    return str(path)


@pytest.fixture
def bastion_proxy(inventory):
    """ct129's sshd behind a loopback TCP proxy on another address and port: a bastion that is
    reachable only where its ssh config Host block says (Hostname, Port)."""
    from orchestrator.lab.proxy import LatencyProxy
    (ct129,) = inventory.select("ct129")
    proxy = LatencyProxy((ct129.address, 22), delay_ms=0).start()
    try:
        yield ct129, proxy.address
    finally:
        proxy.stop()


def _bastion(bastion_proxy, user: str = "nobody", identity: str = "IdentityFile {key}") -> str:
    """The ssh config's block for the bastion: the proxy's address and port, ct129's key name."""
    ct129, (proxy_host, proxy_port) = bastion_proxy
    return (f"Host bastion\n    Hostname {proxy_host}\n    Port {proxy_port}\n    User {user}\n"
            f"    {identity}\n    HostKeyAlias {ct129.address}\n")


def test_proxy_jump_through_a_bastion_with_its_own_host_block(lab, inventory, bastion_proxy, tmp_path):
    from orchestrator.fleet.inventory import load_inventory
    _, (proxy_host, proxy_port) = bastion_proxy
    ct130 = inventory.hosts["ct130"]
    # 'bastion' is no name anything resolves, nothing listens on its port 22, and the target's key
    # (ansible_ssh_private_key_file) is not passed to a hop: only the block's own Hostname, Port,
    # IdentityFile (and HostKeyAlias, the name its key is recorded under) reach ct129, as its User.
    config = _lab_config(tmp_path, lab, _bastion(bastion_proxy) + f"Host {ct130.address}\n    ProxyJump bastion\n")
    (target,) = load_inventory(lab.inventory_path, ssh_config_path=config).select("ct130")
    (hop,) = target.ssh.hops()
    assert (hop.address, hop.port, hop.user, hop.identity_files) == (proxy_host, proxy_port, "nobody",
                                                                     (str(lab.key_path),))
    with Connection(target, KnownHosts(inventory.known_hosts_path)) as c:
        assert c.run("hostname").stdout == b"ct130\n"
        bastion, inside = c._clients  # the bastion's connection, then the target's inside it
        assert (bastion.get_transport().get_username(), inside.get_transport().get_username()) == ("nobody",
                                                                                                   "root")


def test_a_hop_refused_names_the_route_and_the_config(lab, inventory, bastion_proxy, tmp_path):
    from orchestrator.errors import ConnectError
    from orchestrator.fleet.inventory import load_inventory
    _, (proxy_host, proxy_port) = bastion_proxy
    config = _lab_config(tmp_path, lab, _bastion(bastion_proxy, identity="IdentityFile /nonexistent/key\n"
                                                                    "    IdentityAgent none")
                         + f"Host {inventory.hosts['ct130'].address}\n    ProxyJump bastion\n")
    (target,) = load_inventory(lab.inventory_path, ssh_config_path=config).select("ct130")
    with pytest.raises(ConnectError, match=rf"cannot connect to root@{target.address}:22 via nobody@{proxy_host}:"
                                           rf"{proxy_port} .*No authentication methods.*ssh config in use: {config}"):
        Connection(target, KnownHosts(inventory.known_hosts_path), connect_attempts=1).run("true")


def test_multi_hop_proxy_jump_nests_each_hop(lab, inventory, bastion_proxy, tmp_path):
    from orchestrator.fleet.inventory import load_inventory
    _, (proxy_host, _port) = bastion_proxy
    ct131 = inventory.hosts["ct131"]
    config = _lab_config(tmp_path, lab, _bastion(bastion_proxy, user="root") + f"""
Host inner
    Hostname {ct131.address}
    IdentityFile {{key}}
Host {inventory.hosts["ct132"].address}
    ProxyJump bastion,inner
""")
    (target,) = load_inventory(lab.inventory_path, ssh_config_path=config).select("ct132")
    assert [(h.destination, h.address) for h in target.ssh.hops()] == [("bastion", proxy_host),
                                                                        ("inner", ct131.address)]
    with Connection(target, KnownHosts(inventory.known_hosts_path)) as c:
        assert c.run("hostname").stdout == b"ct132\n"
        assert len(c._clients) == 3  # bastion, inner inside it, the target inside inner


RELAY = """
import socket, sys, threading
upstream = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def send():
    while data := sys.stdin.buffer.raw.read(65536):
        upstream.sendall(data)
    upstream.shutdown(socket.SHUT_WR)
threading.Thread(target=send, daemon=True).start()
while data := upstream.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""


def test_proxy_command_runs_through_the_shell_with_tokens(lab, inventory, tmp_path, monkeypatch):
    """A ProxyCommand that is not nc (a Python relay to %h %p) is refused under the loopback guard;
    with the guard off, which is allowed only in the network jail (only lo exists), it carries the
    connection, run with the user's shell as ssh runs it."""
    import sys

    from orchestrator.errors import LoopbackOnlyError
    from orchestrator.fleet.inventory import load_inventory

    from .conftest import in_network_jail
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    ct131 = inventory.hosts["ct131"]
    config = _lab_config(tmp_path, lab, f"Host {ct131.address}\n    ProxyCommand {sys.executable} {relay} %h %p"
                                        "  # a comment, which the shell drops\n")
    (target,) = load_inventory(lab.inventory_path, ssh_config_path=config).select("ct131")
    assert target.ssh.proxy_command == f"{sys.executable} {relay} {ct131.address} 22  # a comment, which the shell drops"
    with pytest.raises(LoopbackOnlyError, match="refusing the ProxyCommand of host ct131"):
        Connection(target, KnownHosts(inventory.known_hosts_path)).run("true")
    if not in_network_jail():
        pytest.skip("the guard may be off only in the network jail (make test)")
    monkeypatch.delenv("SGLFLEET_LOOPBACK_ONLY")
    with Connection(target, KnownHosts(inventory.known_hosts_path)) as c:
        assert c.run("hostname").stdout == b"ct131\n"
