"""What a command imports: `main()` registers only the family of the command it runs.

Start-up is most of what a small command costs (bench/peers.py): `sglfleet run` must not import
the deploy stage, the profile schema, pydantic, jinja2 or invoke, and help must still list every command.
These run the CLI in subprocesses on a host reached by `ansible_connection: local` (no SSH).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import typer

from orchestrator import cli

from .conftest import ROOT, fenced_env, sglfleet

# Run the real entry point, then print the modules the process imported.
PROBE = ("import atexit, json, sys; from orchestrator.cli import main; "
         "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr)); "
         "sys.argv = ['sglfleet', *sys.argv[1:]]; main()")
NEVER_FOR_RUN = ("jinja2", "invoke", "orchestrator.stages.deploy", "orchestrator.stages.render",
                 "orchestrator.spec.profile", "orchestrator.spec.patchset", "orchestrator.cli.deploy",
                 "orchestrator.lab.manager",
                 # typer 0.29 coerces each parameter through pydantic: ~60 ms of CPU a start (pyproject.toml)
                 "pydantic")


@pytest.fixture
def local_inventory(tmp_path):
    path = tmp_path / "local.yaml"
    path.write_text(f"all:\n  hosts:\n    here:\n      ansible_connection: local\n"
                    f"      ansible_python_interpreter: {sys.executable}\n")
    return path


def imported(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=fenced_env(), timeout=120)
    return done, set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_run_imports_neither_the_deploy_stage_nor_jinja2_nor_invoke(local_inventory):
    done, modules = imported("run", "all", "echo hi", "-i", str(local_inventory), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["hosts"]["here"]["value"]["stdout"] == "hi\n"
    assert "orchestrator.cli.fleet" in modules and "paramiko" in modules  # the transport is there
    assert modules.isdisjoint(NEVER_FOR_RUN), sorted(modules & set(NEVER_FOR_RUN))


def test_run_piped_writes_its_lines_without_importing_rich(local_inventory):
    done, modules = imported("run", "all", "echo hi; echo warn >&2", "-i", str(local_inventory))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("\u2500") and " here ok " in lines[0] and len(lines[0]) == 160, lines
    assert lines[1:] == ["hi", "warn", "1 ok, 0 failed"], lines
    assert re.match(r"here: ok \(\d+\.\d\ds\)$", done.stderr.splitlines()[0]), done.stderr
    assert not {m for m in modules if m.split(".")[0] == "rich"}, sorted(m for m in modules if m.startswith("rich"))


def test_the_global_inventory_option_before_the_command_still_picks_its_family(local_inventory):
    done, modules = imported("-i", str(local_inventory), "facts", "all", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["summary"]["ok"] == 1
    assert modules.isdisjoint(NEVER_FOR_RUN), sorted(modules & set(NEVER_FOR_RUN))


def test_releases_imports_neither_jinja2_nor_the_doctor_stage(local_inventory):
    """The releases family's commands but `plan` (push, rollback, releases) never render: ~0.1 s
    of every such start was the doctor stage, the renderer and jinja2."""
    done, modules = imported("releases", "all", "-i", str(local_inventory), "--json")
    assert "here" in json.loads(done.stdout)["hosts"], done.stdout + done.stderr  # answered (no sglang here)
    assert "orchestrator.cli.releases" in modules
    never = {"jinja2", "orchestrator.stages.doctor", "orchestrator.stages.render"}
    assert modules.isdisjoint(never), sorted(modules & never)


def test_invoke_stays_importable_after_paramiko(local_inventory):
    """ssh_library hides invoke from paramiko's own import only."""
    code = ("from orchestrator.fleet.ssh_library import paramiko; import invoke, paramiko.config; "
            "assert paramiko.config.invoke is None; print(invoke.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "invoke", done.stderr


@pytest.mark.parametrize("family", sorted(cli.FAMILIES))
def test_each_family_registers_exactly_the_commands_it_is_listed_with(family):
    commands = typer.main.get_command(cli.build_app((family,))).commands
    assert sorted(commands) == sorted(cli.FAMILIES[family])


def test_every_command_of_the_whole_cli_has_a_family():
    assert sorted(typer.main.get_command(cli.app).commands) == sorted(cli._FAMILY_OF)


@pytest.mark.parametrize("argv,family", [
    (["run", "all", "uname"], "fleet"), (["-i", "inv.yaml", "run", "all", "x"], "fleet"),
    (["--inventory", "inv.yaml", "deploy"], "deploy"), (["--inventory=inv.yaml", "facts"], "fleet"),
    (["-iinv.yaml", "hosts"], "fleet"), (["lab", "up"], "lab"), (["build-kernels"], "deploy"),
    (["patchset", "init"], "releases"), (["restart", "--rolling"], "rollout"),
    ([], None), (["--help"], None), (["rnu"], None), (["-i"], None),
])
def test_command_family_reads_the_command_after_the_global_options(argv, family):
    assert cli.command_family(argv) == family


def test_help_lists_every_command_and_a_typo_is_still_refused_by_name():
    listed = sglfleet("--help")
    assert listed.returncode == 0
    for command in cli._FAMILY_OF:
        assert command in listed.stdout, command
    typo = sglfleet("rnu", "all")
    assert typo.returncode == 2 and "No such command" in typo.stderr and "rnu" in typo.stderr


def _main_output(argv: list[str], monkeypatch, capsys, all_families: bool) -> tuple[int, str, str]:
    """main() in this process, with only the command's family registered or with every one."""
    if all_families:
        monkeypatch.setattr(cli, "command_family", lambda argv: None)
    monkeypatch.setattr(sys, "argv", ["sglfleet", *argv])
    monkeypatch.setenv("COLUMNS", "100")
    cli.GLOBALS.inventory = None
    with pytest.raises(SystemExit) as done:
        cli.main()
    out, err = capsys.readouterr()
    monkeypatch.undo()
    return done.value.code, out, err


@pytest.mark.parametrize("argv", [["run", "--help"], ["facts", "--help"], ["run", "all", "echo hi"],
                                  ["run", "all", "exit 3"], ["run", "--forks", "0", "all", "true"]])
def test_output_is_the_same_from_the_family_alone_as_from_the_whole_cli(argv, local_inventory, monkeypatch, capsys):
    argv = [*argv, "-i", str(local_inventory)] if "--help" not in argv else argv
    alone = _main_output(argv, monkeypatch, capsys, all_families=False)
    whole = _main_output(argv, monkeypatch, capsys, all_families=True)
    assert alone[1] or alone[2]  # something was printed
    strip = lambda text: re.sub(r"\(\d+\.\d+s\)", "(Ns)", text)  # per-host seconds differ run to run
    assert (alone[0], alone[1], strip(alone[2])) == (whole[0], whole[1], strip(whole[2]))
