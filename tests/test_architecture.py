"""The package's shape (layers, one state path) and the one remote-call convention, without SSH.

The call convention runs here on a `LocalConnection` (the same bootstrap, envelope and errors as
on a host); the SSH path of the same code is exercised by every lab test.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

from orchestrator.errors import RemoteError
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.fleet.remote_call import call

from .conftest import ROOT, sglfleet
from .private_lab import private_lab

PACKAGE = ROOT / "orchestrator"
# Who may import whom: a module imports only modules of its own rank or lower.
RANKS = {"errors": 0, "data": 0, "remote": 1, "spec": 2, "fleet": 2, "stages": 3, "lab": 3, "cli": 4}


def local() -> LocalConnection:
    return LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))


def _module_imports() -> dict[str, set[str]]:
    """orchestrator module -> the orchestrator modules it imports (anywhere in the file)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        package = parts if is_pkg else parts[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("orchestrator"):
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("orchestrator"))
        graph[name] = found
    modules = set(graph)
    return {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"


def test_no_module_imports_upward():
    upward = [(m, t) for m, targets in _module_imports().items() for t in targets
              if _room(m) in RANKS and _room(t) in RANKS and RANKS[_room(t)] > RANKS[_room(m)]]
    assert upward == []


def test_no_import_cycles():
    graph = _module_imports()
    # A package's __init__ importing its own submodules is wiring, not a cycle back into it.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_state_path_is_spelled_in_one_module():
    spelled = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if re.search(r"/var/lib/sglfleet(?![\w-])", p.read_text())]
    assert spelled == ["orchestrator/remote/hostlib.py"]


def test_remote_scripts_are_importable_and_declare_their_commands():
    import importlib

    scripts = sorted(p.stem for p in (PACKAGE / "remote").glob("*.py") if p.stem not in ("__init__", "hostlib"))
    assert {"gather_facts", "server_facts", "smoke_probe", "release", "server", "logs"} <= set(scripts)
    for name in scripts:
        module = importlib.import_module(f"orchestrator.remote.{name}")  # no side effect at import
        assert module.COMMANDS and all(callable(c) for c in module.COMMANDS.values()), name


# ---------------------------------------------------------------- the call convention


def test_call_returns_the_value_and_sends_args_and_payload(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import hashlib\n"
                      "def echo(args, stream):\n"
                      "    print('stray output must not corrupt the envelope')\n"
                      "    data = stream.read()\n"
                      "    return {'args': args, 'sha': hashlib.sha256(data).hexdigest(), 'size': len(data)}\n"
                      "COMMANDS = {'echo': echo}\n")
    payload = bytes(range(256)) * 4096
    value = call(local(), str(script), "echo", {"x": [1, "two"]}, payload=payload)
    assert value == {"args": {"x": [1, "two"]}, "sha": hashlib.sha256(payload).hexdigest(), "size": len(payload)}


def test_call_raises_the_remote_exception_with_its_whole_traceback(tmp_path):
    script = tmp_path / "boom.py"
    lines = ["def level%d(n):\n    return level%d(n)\n" % (i, i + 1) for i in range(40)]
    script.write_text("".join(lines) + "def level40(n):\n    raise KeyError('deep')\n"
                      "COMMANDS = {'boom': lambda args, stream: level0(1)}\n")
    with pytest.raises(RemoteError) as info:
        call(local(), str(script), "boom", {})
    exc = info.value
    assert exc.error_type == "KeyError" and exc.exit_status == 1
    frames = [line for line in exc.remote_traceback.splitlines() if line.strip().startswith("File ")]
    assert len(frames) == 43  # hostlib.serve, the lambda, level0..level40: nothing cut
    assert exc.remote_traceback.rstrip().endswith("KeyError: 'deep'")
    assert exc.remote_traceback.rstrip() in str(exc)


def test_call_keeps_a_refusal_and_its_detail(tmp_path):
    script = tmp_path / "refuse.py"
    script.write_text("import sglfleet_hostlib as hostlib\n"
                      "def refuse(args, stream):\n"
                      "    raise hostlib.Failure('locked by someone', hostlib.EXIT_LOCKED, holder={'user': 'ann'})\n"
                      "COMMANDS = {'refuse': refuse}\n")
    with pytest.raises(RemoteError) as info:
        call(local(), str(script), "refuse", {})
    assert str(info.value) == "local: locked by someone"
    assert info.value.detail == {"holder": {"user": "ann"}} and info.value.exit_status == 3
    assert info.value.remote_traceback is None


def test_call_without_an_answer_shows_everything_the_process_printed(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import os, sys\n"
                      "def die(args, stream):\n"
                      "    sys.stderr.write('last words\\n'); sys.stderr.flush(); os._exit(9)\n"
                      "COMMANDS = {'die': die}\n")
    with pytest.raises(RemoteError) as info:
        call(local(), str(script), "die", {})
    assert info.value.error_type == "NoAnswer" and info.value.exit_status == 9
    assert "last words" in str(info.value) and "exit code 9" in str(info.value)


def test_call_timeout_kills_the_process_group(tmp_path):
    marker = tmp_path / "still-running"
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, time\n"
                      "def hang(args, stream):\n"
                      f"    subprocess.Popen(['sh', '-c', 'sleep 3; touch {marker}'])\n"
                      "    time.sleep(60)\n"
                      "COMMANDS = {'hang': hang}\n")
    with pytest.raises(RemoteError) as info:
        call(local(), str(script), "hang", {}, timeout=1)
    assert "timed out" in str(info.value)
    import time
    time.sleep(3.5)
    assert not marker.exists()  # the child went with its group


def test_call_names_an_unknown_command():
    with pytest.raises(RemoteError, match="release.py has no command 'bogus'"):
        call(local(), "release.py", "bogus", {})


def test_gather_facts_through_the_local_connection():
    from orchestrator.fleet.facts import gather

    values = gather(local())
    assert values["interpreter"]["executable"] == sys.executable and not values["interpreter"]["missing"]
    assert values["hostname"] and isinstance(values["gpus"], list)


def test_gpu_listing_is_parsed_once_from_the_lab_stand_in():
    import subprocess

    from orchestrator.remote import hostlib

    listing = subprocess.run([sys.executable, str(PACKAGE / "lab" / "image" / "nvidia_smi.py"), *hostlib.GPU_QUERY],
                             capture_output=True, text=True, check=True,
                             env={"SGLFLEET_LAB_GPU": "h100", "PATH": "/usr/bin:/bin"}).stdout
    assert hostlib.parse_gpus(listing) == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "580.159.04",
         "compute_cap": "9.0", "arch": "sm_90"}]


# ---------------------------------------------------------------- CLI shape


def test_inventory_option_before_or_after_the_subcommand(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    h1: {ansible_host: 127.0.0.5}\n")
    before = sglfleet("-i", str(inventory), "hosts", "all", "--json")
    after = sglfleet("hosts", "all", "--json", "-i", str(inventory))
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout)["hosts"] == json.loads(after.stdout)["hosts"]
    assert [h["name"] for h in json.loads(before.stdout)["hosts"]] == ["h1"]


def test_the_old_deploy_section_names_its_new_name(tmp_path):
    profile = tmp_path / "old.yaml"
    profile.write_text("name: old\nmodel: {path: /m}\ndeploy:\n  patchset: ../p\n")
    proc = sglfleet("smoke", "--local", str(profile))
    assert proc.returncode == 2
    assert f"{profile}:3: deploy: unknown key 'deploy': it was renamed 'artifacts'" in " ".join(proc.stderr.split())


def test_render_refuses_an_unknown_what():
    proc = sglfleet("render", "ct129", "qwen36-ddtree", "--what", "bogus", "-i", "/nonexistent.yaml")
    assert proc.returncode == 2 and "--what must be one of command, env, unit, launch-script" in proc.stderr


@pytest.mark.lab
@pytest.mark.slow
def test_the_built_wheel_works_outside_the_checkout(tmp_path):
    """Build the wheel from a copy of the tracked sources, install it into a fresh venv, and run
    `sglfleet push` and `render` from a directory that has no playbooks/ or patches/ of its own
    (on a lab of its own: the push leaves a release on the host)."""
    with private_lab("wheel", 1, 1) as lab:
        _wheel_outside_the_checkout(lab, tmp_path)


def _wheel_outside_the_checkout(lab, tmp_path):
    import shutil
    import subprocess
    import sysconfig

    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "setup.py", "README.md", "orchestrator",
                              "templates", "playbooks", "patches", "kernels"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    wheels, venv, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels,
                    src], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
                    "--no-index", *wheels.glob("sglfleet-*.whl")], check=True, capture_output=True)
    # The dependencies come from this venv's site-packages as a plain path: its editable finder
    # for the checkout (a .pth hook) is not run for a path added this way.
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "sglfleet-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLFLEET_PLAYBOOKS")}
    where = subprocess.run([venv / "bin" / "python", "-c", "import orchestrator; print(orchestrator.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    push = subprocess.run([venv / "bin" / "sglfleet", "push", "ct129", "qwen36-ddtree", "-i", lab.inventory_path],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert push.returncode == 0, push.stdout + push.stderr
    for what, expected in (("command", "--speculative-algorithm DDTREE"), ("unit", "ExecStart=")):
        proc = subprocess.run([venv / "bin" / "sglfleet", "render", "ct129", "qwen36-ddtree", "--what", what,
                               "-i", lab.inventory_path], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert expected in " ".join(proc.stdout.split())


def test_companion_scripts_run_in_the_same_process(tmp_path):
    main = tmp_path / "main.py"
    main.write_text("import os, sglfleet_hostlib as hostlib\n"
                    "def both(args, stream):\n"
                    "    helper = hostlib.companion('helper.py')\n"
                    "    return {'helper': helper.answer(args['x']), 'pid_same': helper.PID == os.getpid(),\n"
                    "            'payload': stream.read().decode()}\n"
                    "COMMANDS = {'both': both}\n")
    helper = tmp_path / "helper.py"
    helper.write_text("import os\nPID = os.getpid()\ndef answer(x):\n    return x * 2\n")
    value = call(local(), str(main), "both", {"x": 21}, payload=b"after the companions",
                 companions=(str(helper),))
    assert value == {"helper": 42, "pid_same": True, "payload": "after the companions"}


def test_run_dirs_made_at_once_by_several_processes_are_distinct(tmp_path):
    """Two commands started in the same second each get their own runs/ directory (two concurrent
    deploys once failed here: both made runs/<time>-deploy, one got FileExistsError)."""
    import multiprocessing

    from orchestrator.stages.runs import run_dir

    with multiprocessing.get_context("fork").Pool(8) as pool:
        made = pool.starmap(run_dir, [(tmp_path / "runs", "deploy")] * 24)
    assert len(set(made)) == 24 and all(Path(d).is_dir() for d in made)
