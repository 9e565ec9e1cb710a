"""Rendered files are safe for the format they are in (issue 17 §1), and the profile schema
refuses values out of range (17 §5): no host, no lab.

Property tests (hypothesis) render every template with arbitrary strings in every free-text
profile field and every env value, then RUN the launch script (sh, in a sandbox dir, with a
recorder standing in for the server) and `systemd-analyze verify` the unit: nothing executes
that we did not write, and each value reaches the server exactly as written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import Host
from orchestrator.spec.profile import Profile, ProfileModel, load_profile
from orchestrator.stages.render import RenderError, render, systemd_exec

OPTIONS = ["--model-path", "--served-model-name", "--host", "--port", "--tp-size", "--mem-fraction-static",
           "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-dflash-block-size",
           "--speculative-ddtree-budget", "--speculative-ddtree-topk-cap", "--speculative-ddtree-shadow-linear",
           "--enable-metrics", "--x"]
FACTS = {"python": "/usr/bin/python3", "model": {"exists": True, "hybrid": False}, "draft": {"exists": True},
         "sglang": {"installed": True, "version": "0.5.23", "options": OPTIONS}, "gpus": []}
RECORDER = """import json, os, sys
keys = json.loads(os.environ.get("SGLFLEET_TEST_KEYS", "[]"))
with open(sys.argv[1], "w") as fh:
    json.dump({"argv": sys.argv[2:], "env": {k: os.environ.get(k) for k in keys}}, fh)
"""
# Arbitrary text: every character except NUL (no argv, env file or unit can carry it) and
# lone surrogates (not encodable).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)
NASTY = st.sampled_from(["$(touch PWNED)", "`touch PWNED`", "'; touch PWNED; '", "\"; touch PWNED; \"",
                         "a\ntouch PWNED", "\\\ntouch PWNED", "${HOME}", "%n %% $$", "x\r\ntouch PWNED",
                         "ExecStartPre=/bin/touch PWNED", "\u2028touch PWNED", "#", " lead and trail "])
VALUE = st.one_of(TEXT, NASTY, st.builds(lambda a, b: a + b, NASTY, TEXT))
SLUG = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
KEY = st.from_regex(r"K_[A-Za-z0-9_]{0,12}", fullmatch=True)  # K_: never a variable the shell itself uses


def make_profile(data: dict, where: str = "p") -> Profile:
    # The profile's path lands in every flag's source comment: arbitrary text too.
    return Profile(Path("/profiles") / (where.replace("/", "_").replace("\0", "") + ".yaml"),
                   ProfileModel.model_validate(data), {})


def sandbox_host(name: str, recorder: Path, out: Path) -> Host:
    return Host(name=name, address="127.0.0.1", python=sys.executable,
                vars={"sglfleet_server_command": [sys.executable, str(recorder), str(out)]})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Host paths must be absolute (spec/profile.py): arbitrary text after the leading slash.
@given(name=SLUG, host_name=VALUE, description=VALUE, model=VALUE.map(lambda v: "/" + v), served=VALUE,
       draft=VALUE.map(lambda v: "/" + v),
       extra=st.lists(VALUE, max_size=3), env=st.dictionaries(KEY, VALUE, max_size=4), where=VALUE, inventory=VALUE)
def test_launch_script_and_env_file_run_nothing_and_round_trip(name, host_name, description, model, served, draft,
                                                               extra, env, where, inventory):
    with tempfile.TemporaryDirectory() as tmp:
        box = Path(tmp)
        recorder, out, env_file = box / "recorder.py", box / "out.json", box / "sglang.env"
        recorder.write_text(RECORDER)
        profile = make_profile({"name": name, "description": description,
                                "model": {"path": model, "served_name": served or None},
                                "speculative": {"algorithm": "DDTREE", "draft_model": draft, "ddtree": {"budget": 8}},
                                "server": {"extra_args": ["--x", *extra]}, "env": env}, where)
        rendered = render(sandbox_host(host_name, recorder, out), profile, FACTS, inventory)
        launch = box / "launch.sh"
        launch.write_text(rendered.template("launch.sh.j2", env_file=str(env_file)))
        env_file.write_text(rendered.template("sglang.env.j2"))
        before = sorted(os.listdir(box))
        run_env = {"PATH": "/usr/bin:/bin", "SGLFLEET_TEST_KEYS": json.dumps(sorted(env))}
        proc = subprocess.run(["sh", str(launch)], cwd=box, env=run_env, capture_output=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(out.read_text())
        assert got["argv"] == rendered.argv  # every flag value exactly as written
        assert got["env"] == env  # every env value exactly as written
        assert sorted(os.listdir(box)) == sorted(before + ["out.json"])  # nothing else ran (no PWNED)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=SLUG, host_name=VALUE, description=VALUE, env=st.dictionaries(KEY, VALUE, max_size=3))
def test_unit_verifies_and_carries_no_injected_line(name, host_name, description, env):
    with tempfile.TemporaryDirectory() as tmp:
        box = Path(tmp)
        launch = box / "servers" / name / "launch.sh"
        launch.parent.mkdir(parents=True)
        launch.write_text("#!/bin/sh\n")
        launch.chmod(launch.stat().st_mode | stat.S_IEXEC)
        profile = make_profile({"name": name, "description": description, "model": {"path": "/m"}, "env": env})
        rendered = render(Host(name=host_name, address="127.0.0.1"), profile, FACTS, "inv")
        unit = box / f"sglfleet-{name}.service"
        unit.write_text(rendered.template("sglang-server.service.j2", launch_script=str(launch), stop_timeout_s=600))
        proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        directives = [line.split("=", 1)[0] for line in unit.read_text().splitlines()
                      if line and not line.startswith(("#", "["))]
        assert directives == ["Description", "After", "Wants", "Type", "ExecStart", "Restart", "RestartSec",
                              "KillSignal", "KillMode", "TimeoutStopSec", "SuccessExitStatus", "StandardOutput",
                              "StandardError", "WantedBy"]
        text = unit.read_text()
        assert f"ExecStart={launch}\n" in text and f"Description=SGLang server ({name}) managed by sglfleet\n" in text


def test_unit_has_the_drain_settings():
    profile = make_profile({"name": "p", "model": {"path": "/m"}})
    text = render(Host(name="h", address="127.0.0.1"), profile, FACTS, "inv").template(
        "sglang-server.service.j2", launch_script="/var/lib/sglfleet/servers/p/launch.sh", stop_timeout_s=600)
    for line in ("KillMode=mixed", "TimeoutStopSec=600", "SuccessExitStatus=137", "KillSignal=SIGTERM"):
        assert f"\n{line}\n" in text


def test_systemd_exec_escapes_arguments_and_refuses_an_odd_executable():
    assert systemd_exec(["/bin/x", 'a b', '50%', '$HOME', 'q"\\']) == '/bin/x "a b" "50%%" "$$HOME" "q\\"\\\\"'
    with pytest.raises(RenderError, match="plain absolute path"):
        systemd_exec(["/bin/x y"])


@pytest.mark.parametrize("name", ["a\nb", "x; rm -rf /", "../etc", "", "-x", "a b", "é"])
def test_profile_name_must_be_a_safe_slug(name):
    with pytest.raises(Exception, match="safe slug"):
        ProfileModel.model_validate({"name": name})


@pytest.mark.parametrize("key", ["A B", "1A", "A;touch x", "A\nB", "A-B", ""])
def test_env_keys_must_be_variable_names(key):
    with pytest.raises(Exception, match="not a variable name"):
        ProfileModel.model_validate({"name": "p", "env": {key: "v"}})


def write_profile(tmp_path, body):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nmodel:\n  path: /m\n" + body)
    return str(path)


@pytest.mark.parametrize("body, needle", [
    ("speculative:\n  algorithm: DDTREE\n  draft_model: /d\n  ddtree:\n    budget: -5\n", "budget"),
    ("speculative:\n  algorithm: DDTREE\n  draft_model: /d\n  ddtree:\n    budget: 0\n", "budget"),
    ("speculative:\n  algorithm: DDTREE\n  draft_model: /d\n  ddtree:\n    budget: 8\n    topk_cap: 9\n",
     "topk_cap (9) cannot exceed budget (8)"),
    ("server:\n  port: -1\n", "port"),
    ("server:\n  port: 70000\n", "port"),
    ("server:\n  tp: 0\n", "tp"),
    ("server:\n  mem_fraction: 1.5\n", "mem_fraction"),
])
def test_out_of_range_values_are_refused_with_file_and_line(tmp_path, body, needle):
    with pytest.raises(ConfigError) as info:
        load_profile(write_profile(tmp_path, body))
    assert needle in str(info.value) and "p.yaml:" in str(info.value)


def test_profile_overrides_of_the_wrong_shape_are_one_clear_error(tmp_path):
    profile = load_profile(write_profile(tmp_path, ""))
    for overrides in (["server"], {"p": ["port", 1]}):
        with pytest.raises((ConfigError, RenderError)) as info:
            render(Host(name="h", address="127.0.0.1", vars={"sglfleet_profile_overrides": overrides}), profile, FACTS, "inv")
        assert "sglfleet_profile_overrides" in str(info.value) and "mapping" in str(info.value)


def test_missing_draft_model_is_named_with_the_fix(tmp_path):
    profile = load_profile(write_profile(tmp_path, "speculative:\n  algorithm: DFLASH\n  draft_model: /nope\n"))
    facts = dict(FACTS, draft={"path": "/nope", "exists": False})
    with pytest.raises(RenderError, match=r"draft model /nope does not exist on the host .*p\.yaml:\d+"):
        render(Host(name="h", address="127.0.0.1"), profile, facts, "inv")


def test_lab_host_bind_override_and_wildcard_refusal(tmp_path):
    profile = load_profile(write_profile(tmp_path, "server:\n  host: 0.0.0.0\n"))
    lab = {"sglfleet_lab_gpu": "h200"}
    rendered = render(Host(name="ct129", address="127.0.1.1", vars={**lab, "sglfleet_server_bind": "127.0.1.1"}), profile,
                      FACTS, "inventory/lab.yaml")
    assert rendered.bind == "127.0.1.1" and rendered.argv[rendered.argv.index("--host") + 1] == "127.0.1.1"
    with pytest.raises(RenderError, match="lab host and would bind 0.0.0.0.*share one network namespace"):
        render(Host(name="ct129", address="127.0.1.1", vars=lab), profile, FACTS, "inventory/lab.yaml")
    # Not a lab host: 0.0.0.0 is the user's choice.
    assert render(Host(name="gpu1", address="127.0.1.1"), profile, FACTS, "inv").bind == "0.0.0.0"


def test_server_command_replaces_the_launcher_and_is_labeled(tmp_path):
    profile = load_profile(write_profile(tmp_path, ""))
    rendered = render(Host(name="ct129", address="127.0.1.1", vars={
        "sglfleet_server_command": ["/usr/local/bin/sglfleet-sim-server"], "sglfleet_server_command_label": "LAB SIMULATION: x"}),
        profile, FACTS, "inventory/lab.yaml")
    assert rendered.command[:2] == ["/usr/local/bin/sglfleet-sim-server", "--model-path"]
    script = rendered.template("launch.sh.j2", env_file="/e")
    assert re.search(r"^# server command: inventory/lab.yaml \(ct129: sglfleet_server_command\): LAB SIMULATION: x$", script,
                     re.M)
    plain = render(Host(name="gpu1", address="127.0.1.1", python="/py"), profile, FACTS, "inv")
    assert plain.command[:3] == ["/py", "-m", "sglang.launch_server"]
