"""What the connection does once per command instead of once per host, with paramiko's answers:
known_hosts read into an index by name, private keys read once; and the ciphers it offers. No SSH."""

from __future__ import annotations

import os
import subprocess

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.ssh_library import paramiko
from orchestrator.fleet.transport import private_key


def _key(kind: str, tmp_path, name: str) -> paramiko.PKey:
    path = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True)
    return paramiko.PKey.from_path(path)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    return {n: _key(kind, tmp, n) for n, kind in (("a", "ed25519"), ("b", "ed25519"), ("c", "ecdsa"),
                                                  ("d", "ed25519"))}


def _line(names: str, key: paramiko.PKey) -> str:
    return f"{names} {key.get_name()} {key.get_base64()}\n"


def test_keys_for_gives_what_paramikos_lookup_gives(keys, tmp_path):
    hashed_b = paramiko.HostKeys.hash_host("10.0.0.2")
    hashed_d = paramiko.HostKeys.hash_host("10.0.0.1")
    text = ("# a comment\n\n"
            + _line("10.0.0.1,gpu-1", keys["a"])
            + _line("[10.0.0.1]:2222", keys["b"])
            + _line(hashed_b, keys["b"])
            + _line("10.0.0.1", keys["c"])               # another type for 10.0.0.1
            + _line(hashed_d, keys["d"])                 # same type as line 1, later: line 1 wins
            + _line("gpu-1", keys["b"])                  # same type again, later: ignored
            + _line(f"10.0.0.3,{paramiko.HostKeys.hash_host('gpu-3')}", keys["c"]))
    path = tmp_path / "known_hosts"
    path.write_text(text)
    reference = paramiko.HostKeys()
    reference.load(str(path))
    ours = KnownHosts(path)
    names = ["10.0.0.1", "gpu-1", "[10.0.0.1]:2222", "10.0.0.2", "10.0.0.3", "gpu-3", "nowhere", hashed_b]
    for name in names:
        expected = reference.lookup(name)
        expected = {t: k.get_base64() for t, k in dict(expected).items()} if expected else {}
        assert {t: k.get_base64() for t, k in ours.keys_for(name).items()} == expected, name
    assert ours.keys_for("10.0.0.1")["ssh-ed25519"].get_base64() == keys["a"].get_base64()
    assert set(ours.keys_for("10.0.0.2")) == {"ssh-ed25519"}  # the hashed entry


def test_a_changed_file_is_read_again(keys, tmp_path):
    path = tmp_path / "known_hosts"
    ours = KnownHosts(path)
    assert ours.keys_for("10.0.0.1") == {}  # no file yet
    path.write_text(_line("10.0.0.1", keys["a"]))
    assert ours.keys_for("10.0.0.1")["ssh-ed25519"].get_base64() == keys["a"].get_base64()
    ours.add("10.0.0.9", keys["c"])
    assert set(ours.keys_for("10.0.0.9")) == {"ecdsa-sha2-nistp256"}


def test_a_broken_line_is_refused_with_its_line(keys, tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(_line("10.0.0.1", keys["a"]) + "10.0.0.2 ssh-ed25519 AAAAnot-base64!!\n")
    with pytest.raises(ConfigError) as err:
        KnownHosts(path).keys_for("10.0.0.1")
    assert f"{path}:2" in str(err.value) or "line 2" in str(err.value)


def test_a_private_key_is_read_once_while_its_file_is_unchanged(tmp_path):
    path = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    first = private_key(str(path))
    assert isinstance(first, paramiko.Ed25519Key) and private_key(str(path)) is first
    path.unlink()
    os.unlink(f"{path}.pub")
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(path)], check=True)
    again = private_key(str(path))
    assert isinstance(again, paramiko.ECDSAKey)  # a new file: read again


def test_a_key_that_needs_a_passphrase_or_is_missing_goes_to_paramiko_as_a_file(tmp_path):
    locked = tmp_path / "id_locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)], check=True)
    assert private_key(str(locked)) is None
    assert private_key(str(tmp_path / "missing")) is None


def test_line_of_names_the_first_entry_for_a_name_hashed_or_not(keys, tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("# comments and blank lines count as lines\n\n" + _line("10.0.0.1", keys["a"])
                    + _line(paramiko.HostKeys.hash_host("10.0.0.2"), keys["b"]) + _line("10.0.0.2", keys["c"]))
    ours = KnownHosts(path)
    assert (ours.line_of("10.0.0.1"), ours.line_of("10.0.0.2"), ours.line_of("10.0.0.3")) == (3, 4, None)


def test_the_transport_offers_aes_gcm_first_and_keeps_every_other_cipher():
    import socket

    from orchestrator.fleet.transport import AEAD_CIPHERS, _aead_first

    mine, theirs = socket.socketpair()
    try:
        default = paramiko.Transport(theirs).get_security_options().ciphers
        offered = _aead_first(mine).get_security_options().ciphers
    finally:
        mine.close()
        theirs.close()
    assert offered[:2] == AEAD_CIPHERS and sorted(offered) == sorted(default)
