"""The seed story on lab hosts with the real SGLang: smoke, full tracebacks, diagnosis, fan-out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .conftest import ROOT, TEST_HOSTS, sglfleet
from .direct import run_python

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def profile_variant(tmp_path, name, replace):
    text = (ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text().replace("../", f"{ROOT}/")
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def from_sglang(traceback: str) -> list[str]:
    """A traceback's lines from its first frame inside the sglang package to the end."""
    lines = traceback.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  File ") and "/sglang/" in line)
    return lines[first:]


def smoke_json(lab, tmp_path, *args):
    return smoke_json_env(lab, tmp_path, None, *args)


def test_seed_story_hybrid_flags_left_out_then_rendered(lab, inventory, tmp_path):
    push = sglfleet("push", "ct129", "qwen36-ddtree", "-i", str(lab.inventory_path))
    assert push.returncode == 0, push.stdout + push.stderr
    off = profile_variant(tmp_path, "seed-off", {"hybrid: auto": "hybrid: off"})
    code, doc = smoke_json(lab, tmp_path, "ct129", off)
    assert code == 1
    host = doc["hosts"]["ct129"]
    assert not host["ok"] and host["phase"] == "validate"
    assert host["probe"]["exception"]["type"] == "ValueError"
    assert "--speculative-ddtree-allow-hybrid-unsafe" not in host["render"]["command"]
    stored = (Path(doc["run_dir"]) / "ct129.traceback.txt").read_text()
    assert stored == host["probe"]["traceback"] and stored.startswith("Traceback (most recent call last):")
    assert "raise ValueError(" in stored and "cannot branch across tree siblings" in stored.splitlines()[-1]
    # SGLang called directly on the host with the same argv, by a script that shares no code with
    # the probe or the controller, gives the same traceback from SGLang's first frame to the end
    # (the frames above it are the caller's own: the probe's function or the script's module).
    with Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path)) as conn:
        argv = [arg for flag in host["render"]["flags"] for arg in (flag["flag"], *flag["values"])]
        direct = run_python(conn, Path(__file__).parent / "remote" / "direct_traceback.py", [json.dumps(argv)])
    assert direct.ok, direct.stderr_text
    independent = json.loads(direct.stdout)["traceback"]
    assert independent is not None and independent.startswith("Traceback (most recent call last):")
    assert len(from_sglang(independent)) > 12, independent  # long enough that a cut one would differ
    assert from_sglang(stored) == from_sglang(independent)
    assert stored.splitlines()[0] == "Traceback (most recent call last):"
    assert any("--mamba-radix-cache-strategy extra_buffer --mamba-full-memory-ratio 0.5 "
               "--speculative-ddtree-allow-hybrid-unsafe" in fix for fix in host["diagnosis"])

    code, doc = smoke_json(lab, tmp_path, "ct129", "qwen36-ddtree")
    fields = doc["hosts"]["ct129"]["probe"]["fields"]
    assert code == 0, doc["hosts"]["ct129"].get("summary")
    assert [fields[k] for k in ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
                                "speculative_ddtree_topk_cap", "speculative_ddtree_shadow_linear")] == \
        ["DDTREE", 16, 64, 64, True]
    assert doc["hosts"]["ct129"]["simulate"] == "h200"  # the lab host's declared GPU


def test_renamed_flag_fails_at_render_time_against_the_hosts_sglang(lab, tmp_path):
    old = profile_variant(tmp_path, "old-flag", {'extra_args: ["--enable-metrics"': 'extra_args: '
                                                 '["--mamba-scheduler-strategy", "extra_buffer", "--enable-metrics"'})
    proc = sglfleet("render", "ct129", old, "-i", str(lab.inventory_path))
    assert proc.returncode == 2
    message = " ".join(proc.stderr.split())
    assert "--mamba-scheduler-strategy" in message and "SGLang 0.5.23" in message
    assert "renamed" in message and "use --mamba-radix-cache-strategy" in message


def test_smoke_on_8_hosts_one_missing_model_fails_alone(lab, inventory, tmp_path):
    assert TEST_HOSTS >= 8
    broken = "ct136"
    with Connection(inventory.hosts[broken], KnownHosts(inventory.known_hosts_path)) as conn:
        assert conn.run("mv /root/models/Qwen3-8B /root/models/.Qwen3-8B.away").ok
        try:
            code, doc = smoke_json(lab, tmp_path, "all", "qwen3-8b-dflash")
        finally:
            assert conn.run("mv /root/models/.Qwen3-8B.away /root/models/Qwen3-8B").ok
    assert code == 1 and doc["summary"] == {"ok": TEST_HOSTS - 1, "failed": 1}
    failed = doc["hosts"][broken]
    assert failed["phase"] == "render"
    assert "model path /root/models/Qwen3-8B does not exist on the host" in failed["summary"]
    for name, host in doc["hosts"].items():
        if name != broken:
            assert host["ok"] and host["probe"]["fields"]["speculative_algorithm"] == "DFLASH", name
    assert sorted(p.name for p in Path(doc["run_dir"]).glob("*.json")) == sorted(f"{h}.json" for h in doc["hosts"])


def test_a_host_new_to_an_sglang_takes_its_option_list_from_the_controller(lab, inventory, tmp_path):
    """Listing SGLang's options imports it (seconds of the host's CPU): a host whose own cache
    lacks the list is answered from the controller's, and the smoke probe (SGLang imported anyway)
    leaves the list in the host's cache for the next plan."""
    cache = "/var/lib/sglfleet/cache"
    own = {"XDG_CACHE_HOME": str(tmp_path / "controller-cache")}  # this test's controller cache, empty
    with Connection(inventory.hosts["ct133"], KnownHosts(inventory.known_hosts_path)) as conn:
        assert conn.run(f"rm -f {cache}/options-v2-*.json").ok
        code, first = smoke_json_env(lab, tmp_path, own, "ct133", "qwen3-8b-dflash")
        assert code == 0, first["hosts"]["ct133"].get("summary")
        options = first["hosts"]["ct133"]["render"]["options"]
        assert options["from"] == "listed" and len(options["fingerprint"]) == 24  # neither cache had it
        stored = tmp_path / "controller-cache" / "sglfleet" / "sglang-options" / f"{options['fingerprint']}.json"
        assert "--speculative-algorithm" in json.loads(stored.read_text())["options"]

        assert conn.run(f"rm -f {cache}/options-v2-*.json").ok  # the host forgets; the controller knows
        code, second = smoke_json_env(lab, tmp_path, own, "ct133", "qwen3-8b-dflash")
        assert code == 0, second["hosts"]["ct133"].get("summary")
        assert second["hosts"]["ct133"]["render"]["options"] == {"fingerprint": options["fingerprint"],
                                                                 "from": "controller"}
        # the render checked its flags against that list, and the probe left the same list in the
        # host's cache (the next plan reads it there), sent to the controller, not stored in runs/
        kept = conn.run(f"cat {cache}/options-v2-{options['fingerprint']}.json")
        assert kept.ok and json.loads(kept.stdout_text) == json.loads(stored.read_text())
        assert "options_listed" not in second["hosts"]["ct133"]["probe"]
        assert second["hosts"]["ct133"]["probe"]["timings"]["options_s"] < 5


def smoke_json_env(lab, tmp_path, env, *args):
    proc = sglfleet("smoke", *args, "-i", str(lab.inventory_path), "--json", "--runs-dir", str(tmp_path / "runs"),
                    env=env)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_local_preflight_runs_the_same_probe_without_a_host(lab, tmp_path):
    """--local against a local SGLang: the lab's base image venv, run in place on this machine."""
    from orchestrator.lab.base import base_dir

    base = base_dir()
    python = base / "root" / "ml-env" / "bin" / "python3"
    text = (ROOT / "playbooks" / "qwen3-8b-dflash.yaml").read_text().replace("/root/models", f"{base}/root/models")
    profile = tmp_path / "local.yaml"
    profile.write_text(text)
    proc = sglfleet("smoke", "--local", str(profile), "--python", str(python), "--simulate", "h200", "--json",
                    "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    local = json.loads(proc.stdout)["hosts"]["local"]
    assert local["ok"] and local["simulate"] == "h200"
    assert local["probe"]["fields"]["speculative_algorithm"] == "DFLASH"
    assert local["probe"]["fields"]["speculative_num_draft_tokens"] == 16
    assert local["probe"]["python"] == str(python)
