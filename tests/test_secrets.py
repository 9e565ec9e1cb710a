"""One redaction policy (remote/redact.py) for what leaves a host or is printed and stored here:
argv flag values, secret-named env values and token-shaped text, in bundles, runs/ records, the
CLI's output and --json; host files that hold a secret are owner-only. Unit tests on temp dirs
(the host side through the real call convention on a LocalConnection), then a deploy on a lab
host (real sshd) whose bundle and runs/ are searched byte for byte."""

from __future__ import annotations

import json
import os
import stat
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from orchestrator.cli import output
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.remote import hostlib, redact, server
from orchestrator.remote import logs as remote_logs
from orchestrator.stages import logs as stage
from orchestrator.stages import runs

from .private_lab import deploy_profile, lab_fixture

API_KEY = "sk-lab-api-key-0123456789abcdef"
ADMIN_KEY = "admin-secret-4711-xyz"
HF_TOKEN = "hf_do_not_leak_me"
SECRETS = (API_KEY, ADMIN_KEY, HF_TOKEN)

lab = lab_fixture("secrets", 27, hosts=1)


def local() -> LocalConnection:
    return LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))


def test_secret_flags_and_tokens_in_an_argv():
    argv = ["python", "-m", "sglang.launch_server", "--api-key", API_KEY, f"--admin-api-key={ADMIN_KEY}",
            "--hf-token", "tok1", "--db-password", "pw", "--my-secret", "s3", "--ssl-keyfile", "/etc/k.pem",
            "--max-total-tokens", "4096", "--note", f"key {API_KEY} here", "--port", "30000"]
    out = redact.argv(argv)
    assert not any(s in " ".join(out) for s in (API_KEY, ADMIN_KEY, "tok1"))
    assert out[out.index("--db-password") + 1].startswith("<redacted") and out[out.index("--my-secret") + 1] != "s3"
    # not secrets: a key *file*, a token *count*, a port
    assert out[out.index("--ssl-keyfile") + 1] == "/etc/k.pem" and "4096" in out and "30000" in out
    assert redact.secret_values(argv, {"HF_TOKEN": HF_TOKEN, "PORT": "1"}) == sorted(
        {API_KEY, ADMIN_KEY, HF_TOKEN, "tok1"}, key=len, reverse=True)  # 'pw', 's3': too short to search


def test_free_text_loses_every_form_of_a_secret():
    values = redact.secret_values(["--api-key", "a key with 'quotes'"], {"OPENAI_API_KEY": "v$al%ue123"})
    script = "exec /bin/x --api-key 'a key with '\"'\"'quotes'\"'\"'' \nEnvironment=K=v$$al%%ue123\n{\"k\": \"a key with 'quotes'\"}"
    shown = redact.text(script, values)
    assert "quotes" not in shown and "ue123" not in shown
    assert redact.text("Bearer sk-abcdefghijklmnop1234", ()) == "Bearer <redacted by sglfleet: 23 characters>"


def test_a_stream_is_masked_in_place_across_chunk_boundaries():
    data = b"x" * 70_000 + API_KEY.encode() + b"y" * 4090 + b" sk-zzzzzzzzzzzzzzzz " + b"z" * 10
    for step in (1000, 4096, 65536, 7):
        mask = redact.StreamMask([API_KEY])
        out = b"".join(mask.feed(data[i:i + step]) for i in range(0, len(data), step)) + mask.finish()
        assert len(out) == len(data) and API_KEY.encode() not in out and b"sk-zzzz" not in out, step
        assert out.replace(b"<redacted", b"").count(b"x") >= 69_000


def state_with_secrets(tmp_path: Path) -> dict:
    """A host state dir as deploy leaves it, the secrets in the argv, env, record and logs."""
    paths = remote_logs.paths_for({"profile": "p", "log_dir": str(tmp_path), "state_dir": str(tmp_path / "state")})
    argv = ["/usr/bin/python3", "-m", "sglang.launch_server", "--api-key", API_KEY,
            f"--admin-api-key={ADMIN_KEY}", "--port", "30000"]
    os.makedirs(paths["dir"], exist_ok=True)
    import shlex

    Path(paths["launch_script"]).write_text(f"#!/bin/sh\n# --api-key: profile.yaml:3\nexec {shlex.join(argv)}\n")
    Path(paths["env_file"]).write_text(f"HF_TOKEN={HF_TOKEN}\nSGLANG_X=1\n")
    Path(paths["record"]).write_text(json.dumps({"argv": argv, "env_hash": "x"}))
    with open(paths["log"], "w") as fh:
        fh.write(f"server_args=ServerArgs(api_key='{API_KEY}', admin_api_key='{ADMIN_KEY}')\n")
        fh.write("x" * (remote_logs.BLOCK - 5) + API_KEY + "\n")  # split across the reader's blocks
        fh.write(f"HF_TOKEN is {HF_TOKEN}\n" * 3)
    return paths


def grep_bundle(archive: Path) -> list[str]:
    hits = []
    data = archive.read_bytes()
    hits += [f"{archive.name}: {s}" for s in SECRETS if s.encode() in data]
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            content = tar.extractfile(member).read() if member.isfile() else b""
            hits += [f"{member.name}: {s}" for s in SECRETS if s.encode() in content]
    return hits


def test_a_bundle_holds_no_secret_and_its_logs_keep_their_size(tmp_path):
    paths = state_with_secrets(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    query = stage.Query(profile="p", extra={"log_dir": str(tmp_path), "state_dir": str(tmp_path / "state"),
                                            "source": "file"})
    result = stage.bundle_host(local(), query, out, tmp_path / "runs", threading.Semaphore(1))
    archive = out / "local.tar.gz"
    assert result["not_collected"] and grep_bundle(archive) == []
    with tarfile.open(archive) as tar:
        log = tar.extractfile("logs/p.log").read()
        script = tar.extractfile("server/launch.sh").read().decode()
        env = tar.extractfile("server/sglang.env").read().decode()
    assert len(log) == os.path.getsize(paths["log"])
    assert "--api-key <redacted" in script and "SGLANG_X=1" in env and "HF_TOKEN=<redacted" in env


def test_runs_records_and_printed_json_hold_no_secret(tmp_path, capsys):
    document = {"command_line": f"python --api-key {API_KEY}", "render": {
        "command": ["python", "--api-key", API_KEY, f"--admin-api-key={ADMIN_KEY}"], "env": {"HF_TOKEN": HF_TOKEN},
        "flags": [{"flag": "--api-key", "values": [API_KEY]}]},
        "probe": {"traceback": f"ValueError: ServerArgs(api_key='{API_KEY}')"}}
    runs.write_json(tmp_path / "h.json", document)
    runs.write_text(tmp_path / "h.traceback.txt", document["probe"]["traceback"], like=document)
    for path in tmp_path.iterdir():
        assert not [s for s in SECRETS if s in path.read_text()], path
    output.print_json(document)
    printed = capsys.readouterr().out
    assert not [s for s in SECRETS if s in printed] and json.loads(printed)["render"]["env"]["HF_TOKEN"].startswith(
        "<redacted")


def test_what_the_cli_prints_loses_every_secret_it_has_rendered(capsys):
    redact.remember(["--api-key", "rendered-key-value-42"], {"MY_PASSWORD": "hunter2hunter2"})
    output.write_host_text("Traceback: api_key='rendered-key-value-42' pw=hunter2hunter2\n")
    output.stdout.print(output.escape("argv: --api-key rendered-key-value-42"))
    printed = capsys.readouterr().out
    assert "rendered-key-value-42" not in printed and "hunter2hunter2" not in printed and "<redacted" in printed


def test_host_files_that_hold_a_secret_are_owner_only(tmp_path):
    paths = {"env_file": str(tmp_path / "sglang.env"), "launch_script": str(tmp_path / "launch.sh"),
             "dir": str(tmp_path)}
    old = os.umask(0o022)
    try:
        server.write_generation(paths, {"env": "A=1\n", "launch_script": "#!/bin/sh\n", "unit": "[Unit]\n"})
        hostlib.write_json_atomic(str(tmp_path / "deployment.json"), {"argv": []}, 0o600)
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)
             for name in ("sglang.env", "launch.sh", "deployment.json")}
    assert modes == {"sglang.env": 0o600, "launch.sh": 0o700, "deployment.json": 0o600}


@pytest.mark.lab
@pytest.mark.slow
def test_a_deploy_with_an_api_key_and_a_secret_env_leaves_no_secret_in_the_bundle_or_runs(lab, tmp_path):
    from .conftest import sglfleet

    profile = deploy_profile(tmp_path, "secret", replace={
        'extra_args: ["--enable-metrics"': f'extra_args: ["--api-key", "{API_KEY}", "--admin-api-key={ADMIN_KEY}", '
                                           '"--enable-metrics"'})
    assert API_KEY in Path(profile).read_text()
    runs_dir = tmp_path / "runs"
    inv = ["-i", str(lab.inventory_path)]
    deployed = sglfleet("deploy", "ct129", profile, "--json", "--runs-dir", str(runs_dir), *inv)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    shown = [sglfleet("status", "ct129", profile, *inv), sglfleet("status", "ct129", profile, "--json", *inv),
             sglfleet("render", "ct129", profile, *inv), sglfleet("render", "ct129", profile, "--json", *inv),
             sglfleet("deploy", "ct129", profile, "--dry-run", *inv), deployed]
    for proc in shown:
        assert not [s for s in SECRETS if s in proc.stdout + proc.stderr], proc.args
    bundled = sglfleet("logs", "--bundle", "ct129", "--runs-dir", str(runs_dir), *inv)
    assert bundled.returncode == 0, bundled.stdout + bundled.stderr
    archives = list(runs_dir.glob("*-logs/ct129.tar.gz"))
    assert archives and grep_bundle(archives[0]) == []
    files = [p for p in runs_dir.rglob("*") if p.is_file()]
    assert len(files) >= 3 and not [(p, s) for p in files for s in SECRETS if s.encode() in p.read_bytes()]
    with tarfile.open(archives[0]) as tar:
        names = tar.getnames()
    assert {"server/launch.sh", "server/deployment.json", "server/sglang.env"} <= set(names)
    from orchestrator.fleet.hostkeys import KnownHosts
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.fleet.transport import Connection

    from orchestrator.spec.profile import load_profile

    inventory = load_inventory(lab.inventory_path)
    where = hostlib.server_paths(load_profile(profile).name)
    with Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path)) as conn:
        modes = conn.run(f"stat -c '%a %n' {where['launch_script']} {where['env_file']} {where['record']}")
    assert modes.ok, modes.stderr_text
    assert [line.split()[0] for line in modes.stdout_text.splitlines()] == ["700", "600", "600"]
