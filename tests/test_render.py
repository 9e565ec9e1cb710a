"""Profiles and rendering without a host: schema errors with file:line, rules, provenance, flag checks."""

from __future__ import annotations

import shlex
import textwrap

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import Host
from orchestrator.spec.profile import load_profile
from orchestrator.stages.render import RenderError, render
from orchestrator.stages.smoke import diagnose

from .conftest import ROOT

OPTIONS_0523 = ["--model-path", "--served-model-name", "--host", "--port", "--tp-size", "--mem-fraction-static",
                "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-dflash-block-size",
                "--speculative-ddtree-budget", "--speculative-ddtree-topk-cap", "--speculative-ddtree-shadow-linear",
                "--speculative-ddtree-allow-hybrid-unsafe", "--mamba-radix-cache-strategy",
                "--mamba-full-memory-ratio", "--enable-metrics", "--decode-log-interval"]
HYBRID_MODEL = {"path": "/root/models/Qwen3.6-27B", "exists": True, "hybrid": True, "recurrent_layers": 12,
                "architectures": ["Qwen3_5ForConditionalGeneration"]}
DENSE_MODEL = {"path": "/root/models/Qwen3-8B", "exists": True, "hybrid": False, "recurrent_layers": 0,
               "architectures": ["Qwen3ForCausalLM"]}


def facts(options=OPTIONS_0523, model=HYBRID_MODEL, version="0.5.23"):
    return {"python": "/root/ml-env/bin/python3", "model": model, "draft": {"exists": True, "block_size": 16},
            "sglang": {"installed": True, "version": version, "options": options}, "gpus": []}


def host(**vars):
    return Host(name="ct129", address="127.0.1.1", python="/root/ml-env/bin/python3", vars=vars)


def profile_file(tmp_path, text, name="p"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_seed_profile_renders_hybrid_companions_with_their_sources():
    rendered = render(host(), load_profile("qwen36-ddtree"), facts())
    line = shlex.join(rendered.command)
    assert line.startswith("/root/ml-env/bin/python3 -m sglang.launch_server --model-path /root/models/Qwen3.6-27B")
    argv = rendered.argv
    for flag, value in [("--speculative-algorithm", "DDTREE"), ("--speculative-dflash-block-size", "16"),
                        ("--speculative-ddtree-budget", "64"), ("--speculative-ddtree-topk-cap", "64"),
                        ("--mamba-radix-cache-strategy", "extra_buffer"), ("--mamba-full-memory-ratio", "0.5")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--speculative-ddtree-shadow-linear" in argv and "--speculative-ddtree-allow-hybrid-unsafe" in argv
    sources = {f.name: f.source for f in rendered.flags}
    assert sources["--speculative-ddtree-budget"].endswith("qwen36-ddtree.yaml:13 (speculative.ddtree.budget)")
    assert sources["--mamba-full-memory-ratio"].startswith("hybrid rule (hybrid: auto; Qwen3_5ForConditionalGeneration")
    for companion in ("--mamba-radix-cache-strategy", "--mamba-full-memory-ratio",
                      "--speculative-ddtree-allow-hybrid-unsafe"):
        assert sources[companion].startswith("hybrid rule (hybrid: auto; Qwen3_5ForConditionalGeneration has 12 "
                                             "linear-attention layers)"), companion
        assert sources[companion].endswith("qwen36-ddtree.yaml:18 (hybrid)"), sources[companion]


# Every flag the hybrid rule can add, under either name of the renamed strategy flag.
HYBRID_FLAG_NAMES = {"--mamba-radix-cache-strategy", "--mamba-scheduler-strategy", "--mamba-full-memory-ratio",
                     "--speculative-ddtree-allow-hybrid-unsafe"}


def hybrid_flags_in(rendered):
    return [f.name for f in rendered.flags if f.name in HYBRID_FLAG_NAMES]


def test_dense_model_gets_no_hybrid_flags_and_hybrid_off_drops_them(tmp_path):
    assert hybrid_flags_in(render(host(), load_profile("qwen3-8b-dflash"), facts(model=DENSE_MODEL))) == []
    # The DDTree profile on a dense target: auto adds nothing either.
    assert hybrid_flags_in(render(host(), load_profile("qwen36-ddtree"), facts(model=DENSE_MODEL))) == []
    # The same hybrid model and profile: auto gives all three companions, off drops every one.
    text = (ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text().replace("../", f"{ROOT}/")
    assert "hybrid: auto" in text
    off = tmp_path / "off.yaml"
    off.write_text(text.replace("hybrid: auto", "hybrid: off"))
    assert hybrid_flags_in(render(host(), load_profile("qwen36-ddtree"), facts())) == [
        "--mamba-radix-cache-strategy", "--mamba-full-memory-ratio", "--speculative-ddtree-allow-hybrid-unsafe"]
    rendered_off = render(host(), load_profile(str(off)), facts())
    assert hybrid_flags_in(rendered_off) == []
    assert "--speculative-ddtree-budget" in rendered_off.argv  # only the hybrid flags went


def test_hybrid_off_is_the_word_not_a_yaml_boolean(tmp_path):
    path = profile_file(tmp_path, """\
        name: off-test
        model: {path: /root/models/Qwen3.6-27B}
        hybrid: off
    """)
    assert load_profile(path).model.hybrid == "off"
    assert hybrid_flags_in(render(host(), load_profile(path), facts())) == []


def test_older_sglang_gets_the_old_strategy_flag_name():
    old = [o for o in OPTIONS_0523 if o != "--mamba-radix-cache-strategy"] + ["--mamba-scheduler-strategy"]
    argv = render(host(), load_profile("qwen36-ddtree"), facts(options=old, version="0.5.2")).argv
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert "--mamba-radix-cache-strategy" not in argv


@pytest.mark.parametrize("order", ["new name listed first", "old name listed first"])
def test_sglang_accepting_both_strategy_names_gets_the_new_one_once(order):
    """A transition release accepts the old spelling as an alias: render the current name, and only it."""
    both = [o for o in OPTIONS_0523 if o != "--mamba-radix-cache-strategy"]
    names = ["--mamba-radix-cache-strategy", "--mamba-scheduler-strategy"]
    both += names if order.startswith("new") else names[::-1]
    rendered = render(host(), load_profile("qwen36-ddtree"), facts(options=both, version="0.5.20"))
    argv = rendered.argv
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert "--mamba-scheduler-strategy" not in argv
    assert hybrid_flags_in(rendered) == ["--mamba-radix-cache-strategy", "--mamba-full-memory-ratio",
                                         "--speculative-ddtree-allow-hybrid-unsafe"]


def test_renamed_flag_is_a_render_error_that_explains_the_rename(tmp_path):
    path = profile_file(tmp_path, """\
        name: old-flag
        model: {path: /root/models/Qwen3.6-27B}
        hybrid: off
        server:
          extra_args: ["--mamba-scheduler-strategy", "extra_buffer"]
    """)
    with pytest.raises(RenderError) as err:
        render(host(), load_profile(path), facts())
    message = str(err.value)
    assert "--mamba-scheduler-strategy" in message and "SGLang 0.5.23" in message
    assert "renamed" in message and "use --mamba-radix-cache-strategy" in message
    assert f"{path}:5 (server.extra_args)" in message


def test_unknown_ddtree_flag_names_the_version_the_closest_flag_and_the_patchset():
    options = [o for o in OPTIONS_0523 if "ddtree" not in o] + ["--speculative-ngram-external-sam-budget"]
    with pytest.raises(RenderError) as err:
        render(host(), load_profile("qwen36-ddtree"), facts(options=options))
    assert "--speculative-ddtree-budget" in str(err.value) and "SGLang 0.5.23" in str(err.value)
    assert "closest flag it knows is" in str(err.value) and "sglfleet push" in str(err.value)


def test_missing_model_dir_is_a_clear_render_error():
    with pytest.raises(RenderError, match="model path /root/models/Qwen3.6-27B does not exist on the host"):
        render(host(), load_profile("qwen36-ddtree"), facts(model={"path": "/root/models/Qwen3.6-27B",
                                                                    "exists": False}))


def test_inventory_overrides_win_and_say_so():
    rendered = render(host(sglfleet_profile_overrides={"qwen36-ddtree": {"server": {"port": 31000}}}),
                      load_profile("qwen36-ddtree"), facts(), "inventory/prod.yaml")
    port = next(f for f in rendered.flags if f.name == "--port")
    assert port.values == ["31000"] and port.source == "inventory/prod.yaml (ct129) (sglfleet_profile_overrides.server.port)"


def test_bad_override_and_bad_profile_are_config_errors_with_location(tmp_path):
    with pytest.raises(ConfigError, match="sglfleet_profile_overrides for qwen36-ddtree from .*server.port"):
        render(host(sglfleet_profile_overrides={"qwen36-ddtree": {"server": {"port": "many"}}}),
               load_profile("qwen36-ddtree"), facts())
    path = profile_file(tmp_path, """\
        name: typo
        model: {path: /m}
        speculative:
          algorithm: DDTREE
          draft_model: /d
          ddtre: {budget: 8}
    """)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert f"{path}:6" in str(err.value) and "ddtre" in str(err.value)


def test_templates_quote_once_and_fail_on_undefined():
    rendered = render(host(), load_profile("qwen36-ddtree"), facts())
    script = rendered.template("launch.sh.j2", env_file="/var/lib/sglfleet/sglang env")
    assert "exec " + shlex.join(rendered.command) in script and ". '/var/lib/sglfleet/sglang env'" in script
    assert "SGLANG_HEALTH_CHECK_TIMEOUT=20" in rendered.template("sglang.env.j2")
    import jinja2
    with pytest.raises(jinja2.UndefinedError):
        rendered.template("sglang-server.service.j2")  # launch_script and stop_timeout_s not given


def test_diagnosis_maps_known_failures_to_fixes():
    rendered = render(host(), load_profile("qwen3-8b-dflash"), facts(model=DENSE_MODEL))
    hybrid = {"ok": False, "exception": {"message": "DDTREE on a hybrid target: ... cannot branch across tree "
                                                    "siblings"}, "traceback": ""}
    assert "--mamba-radix-cache-strategy extra_buffer --mamba-full-memory-ratio 0.5 " \
           "--speculative-ddtree-allow-hybrid-unsafe" in diagnose(hybrid, rendered)[0]
    unknown = {"ok": False, "exception": {"message": "argparse exited with status 2"},
               "stderr": "error: unrecognized arguments: --speculative-ddtree-budget 64"}
    assert "push the DDTree patchset" in diagnose(unknown, rendered)[0]
    assert diagnose({"ok": True}, rendered) == []


@pytest.mark.parametrize("undocumented,expected", [
    (["--mamba-radix-cache-strategy"], "--mamba-scheduler-strategy"),   # the new name only an alias here
    (["--mamba-scheduler-strategy"], "--mamba-radix-cache-strategy"),   # the old name kept as an alias
    ([], "--mamba-radix-cache-strategy"),                               # both documented: the new name
])
def test_a_flag_accepted_under_both_names_is_rendered_and_diagnosed_under_the_documented_one(undocumented, expected):
    both = OPTIONS_0523 + ["--mamba-scheduler-strategy"]
    server_facts = facts(options=both)
    server_facts["sglang"]["undocumented"] = undocumented
    rendered = render(host(), load_profile("qwen36-ddtree"), server_facts)
    strategies = [f.name for f in rendered.flags if f.name.startswith("--mamba-") and f.name.endswith("-strategy")]
    assert strategies == [expected]
    rendered.flags = [f for f in rendered.flags if f.name not in (expected, "--mamba-full-memory-ratio")]
    fixes = diagnose({"ok": False, "exception": {"message": "hybrid target: cannot branch across tree siblings"},
                      "traceback": ""}, rendered)
    assert len(fixes) == 1 and f"{expected} extra_buffer" in fixes[0], fixes
    other = ({"--mamba-radix-cache-strategy", "--mamba-scheduler-strategy"} - {expected}).pop()
    assert other not in fixes[0]
