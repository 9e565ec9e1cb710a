"""Remote side of the server facts a render needs, in one process: SGLang's version, the option
strings its launch argparse accepts, the target model's and the draft's config.json, the GPUs.

Command `facts`, args {"model": path, "draft": path or null, "state_dir": dir, "known_options":
[fingerprint, ...]} (the call convention, fleet/remote_call.py). Building SGLang's parser imports
it (4-9 s of CPU), so the option list is cached on the host under the state dir, keyed by the
sglang version and the hash of the files that define its arguments (the fingerprint); a
fingerprint the controller's cache knows (known_options, stages/sglang_options.py) is answered by
name alone. The smoke probe, which imports SGLang anyway, keeps the list too (remember_options).
Stdlib + hostlib only (SGLang is imported only on a miss of both caches); Python 3.8+.
"""

import hashlib
import json
import os
import subprocess
import sys

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib

RECURRENT = ("linear_attention", "mamba", "mamba2", "gated_deltanet", "linear")


def args_fingerprint(root, version):
    """Hash of the files that define SGLang's CLI arguments (patches change them)."""
    digest = hashlib.sha256((version or "").encode())
    paths = [os.path.join(root, "srt", "server_args.py")]
    fields = os.path.join(root, "srt", "arg_groups", "fields")
    if os.path.isdir(fields):
        paths += sorted(os.path.join(fields, n) for n in os.listdir(fields) if n.endswith(".py"))
    for path in paths:
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                digest.update(path.encode() + b"\0" + fh.read())
    return digest.hexdigest()[:24]


# Every option string the parser accepts, and those it accepts but does not document (help
# suppressed: an old spelling kept as an alias), so a flag SGLang accepts under two names is
# rendered under the one it documents. One source for both users: exec'd here (the smoke probe
# lists in its own process, where SGLang is imported already) and run as LIST_OPTIONS.
OPTIONS_OF = """
def options_of(server_args_class):
    import argparse
    parser = argparse.ArgumentParser()
    server_args_class.add_cli_args(parser)
    return {"options": sorted(s for a in parser._actions for s in a.option_strings),
            "undocumented": sorted(s for a in parser._actions if a.help == argparse.SUPPRESS
                                   for s in a.option_strings)}
"""
exec(OPTIONS_OF)
LIST_OPTIONS = OPTIONS_OF + """
import json
from sglang.srt.server_args import ServerArgs
print(json.dumps(options_of(ServerArgs)))
"""


def _cache_path(state_dir, fingerprint):
    return os.path.join(state_dir, hostlib.CACHE_DIR, "options-v2-%s.json" % fingerprint)


def _keep(path, options):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump(options, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a read-only state dir only costs the next call the same seconds


def option_strings(root, version, state_dir, known=()):
    """(options or None, where they came from: "host" | "controller" | None when listed now,
    the error of a listing that failed, the fingerprint). A fingerprint the controller says it
    knows (`known`, its cache: stages/sglang_options.py) is answered by name, without the import."""
    fingerprint = args_fingerprint(root, version)
    cache = _cache_path(state_dir, fingerprint)
    try:
        with open(cache) as fh:
            return json.load(fh), "host", None, fingerprint
    except (OSError, ValueError):
        pass
    if fingerprint in known:
        return None, "controller", None, fingerprint
    result = subprocess.run([sys.executable, "-c", LIST_OPTIONS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd="/")
    if result.returncode != 0:
        return None, None, result.stderr.decode("utf-8", "replace")[-4000:], fingerprint
    options = json.loads(result.stdout)
    _keep(cache, options)
    return options, None, None, fingerprint


def remember_options(server_args_class, state_dir=None):
    """Called where SGLang's ServerArgs is imported already (the smoke probe): the list for the
    files on disk, kept in the host's cache if it lacks it, and returned for the controller's."""
    package = hostlib.locate_package("sglang")
    if not package:
        return None
    fingerprint = args_fingerprint(package["root"], package["version"])
    cache = _cache_path(state_dir or hostlib.STATE_DIR, fingerprint)
    listed = options_of(server_args_class)  # noqa: F821 (defined by exec(OPTIONS_OF) above)
    if not os.path.exists(cache):
        _keep(cache, listed)
    return {"fingerprint": fingerprint, **listed}


def model_facts(path):
    if not path:
        return None
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return {"path": path, "exists": False}
    try:
        with open(config_path) as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        return {"path": path, "exists": True, "config_error": "%s: %s" % (type(exc).__name__, exc)}
    text = config.get("text_config") or config
    layer_types = text.get("layer_types") or text.get("layers_block_type") or []
    recurrent = sum(1 for t in layer_types if str(t).lower() in RECURRENT)
    pattern = text.get("hybrid_override_pattern")
    if not recurrent and isinstance(pattern, str):
        recurrent = pattern.count("M")
    block = config.get("block_size")
    if block is None:
        block = (config.get("dflash_config") or {}).get("block_size")
    return {"path": path, "exists": True, "architectures": config.get("architectures") or [],
            "model_type": config.get("model_type"), "recurrent_layers": recurrent, "hybrid": recurrent > 0,
            "layers": len(layer_types) or text.get("num_hidden_layers"), "block_size": block}


def facts(args, stream=None):
    package = hostlib.locate_package("sglang")
    root, version = (package["root"], package["version"]) if package else (None, None)
    out = {"python": sys.executable, "sglang": {"installed": root is not None, "version": version, "root": root},
           "model": model_facts(args.get("model")), "draft": model_facts(args.get("draft")),
           "gpus": hostlib.gpus()}
    if root is not None:
        listed, cached, error, fingerprint = option_strings(root, version, args.get("state_dir") or hostlib.STATE_DIR,
                                                            args.get("known_options") or ())
        out["sglang"].update(options=listed and listed["options"], undocumented=listed and listed["undocumented"],
                             options_cached=cached, options_error=error, options_fingerprint=fingerprint)
    return out


COMMANDS = {"facts": facts}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
