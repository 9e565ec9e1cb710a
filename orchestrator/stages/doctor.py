"""`doctor`: can this host serve this profile? The checks, their thresholds and their fixes.

    gather(conn, profile, artifacts)   ONE round trip: remote/doctor.py check (server_facts.py,
                                       gather_facts.py and server.py sent along as companions)
    evaluate(host, profile, artifacts, facts) -> [Check]   no connection: pure policy

Checks, in order (a failing one names what was measured, where the setting comes from, and the
fix): gpus, gpu memory, cuda, model, draft, disk, port, clock, versions, extension, worker.

`evaluate` takes facts gathered elsewhere too. Deploy's plan round trip (remote/server.py plan)
sends PLAN_COMPANIONS as well, puts `request(..., port=False)` in its args and calls doctor.py's
`collect` there (the port's holders are already in that plan); `plan_checks` / `plan_refusal` then
judge its answer with the same checks and text, without an extra round trip. The port is left to
deploy's own check on the same facts (it names another profile's server as such). `unserved` is
the one check `plan` runs on its own inspection.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from ..fleet import remote_call
from ..fleet.inventory import Host
from ..remote import hostlib
from ..remote.server import DEFAULT_LOG_KEEP, DEFAULT_LOG_MAX_BYTES, clashes
from ..spec.patchset import ALGORITHMS_NEEDING_A_WORKER
from ..spec.profile import Artifacts, Profile, with_overrides
from . import kernels
from .render import _Sources

SCRIPT = "doctor.py"
COMPANIONS = ("server_facts.py", "gather_facts.py", "server.py")
OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MiB = 1 << 20

# server.mem_fraction unset: SGLang sizes its static pool from the GPU's capacity itself
# (srt/arg_groups/memory_hook.py), which on a large GPU is most of it; this is the share of each
# GPU doctor then wants free (an estimate: set mem_fraction for an exact check).
UNSET_MEM_FRACTION = 0.8
# Free disk each state path needs: releases keep the replaced files and extension builds (MBs
# each); the supervisor's log rotation holds the log and DEFAULT_LOG_KEEP rotations.
MIN_FREE = {"releases": 512 * MiB, "logs": (DEFAULT_LOG_KEEP + 1) * DEFAULT_LOG_MAX_BYTES}
DISK_PATHS = {"releases": hostlib.STATE_DIR, "logs": hostlib.LOG_DIR}
# Clock skew beyond what the round trip cannot tell apart: `logs --since TIME` filters by host
# time, and the merged logs of several hosts are ordered by it.
MAX_SKEW_S = 2.0
WEIGHTS_NEEDED = ("SGLang's own launcher loads the weights: copy them into the directory "
                  "(*.safetensors), or fix the path")


@dataclass
class Check:
    name: str
    status: str          # ok | warn | fail | skip
    detail: str          # what was measured
    fix: str = ""        # what to do (warn, fail)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- what to ask, once per host


def host_profile(host: Host, profile: Profile, inventory_path: str) -> tuple[Profile, _Sources]:
    """The profile as this host runs it (the inventory's sglfleet_profile_overrides applied, as
    render does) and where each of its values came from."""
    overrides = host.vars.get("sglfleet_profile_overrides") or {}
    where = f"{inventory_path} ({host.name})"
    if not isinstance(overrides, dict):
        raise ConfigError(f"{where}: sglfleet_profile_overrides must be a mapping of profile names to overrides")
    mine = overrides.get(profile.name)
    return with_overrides(profile, mine, where), _Sources(profile, mine, where)


def bind_of(host: Host, profile: Profile) -> str:
    """The address the server binds: sglfleet_server_bind over server.host (stages.render's rule)."""
    return str(host.vars.get("sglfleet_server_bind") or profile.model.server.host)


def sglang_launcher(host: Host) -> bool:
    """Whether the host runs SGLang's own launch_server (not a stand-in such as the lab's)."""
    command = host.vars.get("sglfleet_server_command")
    if not command:
        return True
    return "sglang.launch_server" in (command if isinstance(command, str) else " ".join(map(str, command)))


def request(host: Host, profile: Profile | None, artifacts: Artifacts, inventory_path: str = "inventory",
            port: bool = True) -> dict[str, Any]:
    """The args of remote/doctor.py's `check` for the profile as this host runs it (its
    overrides applied); port=False: `collect`'s, for deploy's plan."""
    if profile is not None:
        profile = host_profile(host, profile, inventory_path)[0]
    p = profile.model if profile else None
    patchset = artifacts.patchset
    args: dict[str, Any] = {
        "package": patchset.manifest.package if patchset else "sglang",
        "distributions": sorted(n for n in (patchset.manifest.requires if patchset else {}) if n != "python"),
        "model": p.model.path if p and p.model else None,
        "draft": p.speculative.draft_model if p and p.speculative else None,
        "disk": DISK_PATHS}
    if port and profile is not None and p is not None:
        args["port"] = {"profile": p.name, "port": p.server.port, "bind": bind_of(host, profile)}
    return args


def gather(conn: Any, profile: Profile | None, artifacts: Artifacts, inventory_path: str = "inventory") -> dict[str, Any]:
    """One round trip; the controller's clock around it, for the skew."""
    sent = time.time()
    facts = remote_call.call(conn, SCRIPT, "check", request(conn.host, profile, artifacts, inventory_path), timeout=120,
                             fallback_python=True, companions=COMPANIONS)
    return {**facts, "sent_at": sent, "answered_at": time.time()}


# What deploy's plan round trip sends besides its own companions for `collect`.
PLAN_COMPANIONS = ("gather_facts.py", SCRIPT)
# Checks deploy makes itself on the same facts (its refusal names another profile's server as such).
DEPLOYS_OWN = ("port",)


def plan_checks(host: Host, profile: Profile, artifacts: Artifacts, planned: dict[str, Any], sent_at: float,
                answered_at: float, inventory_path: str = "inventory") -> list[Check]:
    """For deploy's plan step: doctor's checks on what its plan round trip gathered."""
    checks = evaluate(host, profile, artifacts, from_deploy_plan(planned, sent_at, answered_at), inventory_path)
    return [c for c in checks if c.name not in DEPLOYS_OWN]


def plan_refusal(host: Host, profile: Profile, artifacts: Artifacts, planned: dict[str, Any], sent_at: float,
                 answered_at: float, inventory_path: str = "inventory") -> str | None:
    """The failing checks of plan_checks as the one message doctor prints (None: every check
    passes or only warns)."""
    checks = plan_checks(host, profile, artifacts, planned, sent_at, answered_at, inventory_path)
    return refusal_text(host.name, checks) if failing(checks) else None


def from_deploy_plan(planned: dict[str, Any], sent_at: float, answered_at: float) -> dict[str, Any]:
    """Deploy's plan answer (remote/server.py plan, with doctor.py's `collect` in `doctor`) as
    `evaluate`'s facts: the port part comes from that plan's own port holders."""
    running = planned.get("running") or {}
    return {**planned["doctor"], "sent_at": sent_at, "answered_at": answered_at,
            "port": {"holders": planned.get("port_holders") or [], "foreign": planned.get("foreign") or [],
                     "ours": running.get("pid") if running.get("alive") else None}}


# ---------------------------------------------------------------- the checks


def evaluate(host: Host, profile: Profile | None, artifacts: Artifacts, facts: dict[str, Any],
             inventory_path: str = "inventory") -> list[Check]:
    """Every check on one host's facts (its profile overrides applied first). No profile: what
    the host alone says (GPUs, CUDA, disk, clock, versions)."""
    if profile is None:
        return [gpus(None, None, facts), cuda(facts), disk(facts), clock(facts), versions(artifacts, facts)]
    profile, src = host_profile(host, profile, inventory_path)
    return [gpus(profile, src, facts), gpu_memory(profile, src, facts), cuda(facts), model(host, profile, src, facts),
            draft(host, profile, src, facts), disk(facts), port(host, profile, src, facts), clock(facts),
            versions(artifacts, facts), extension(host, profile, artifacts, facts), worker(host, profile, artifacts)]


def failing(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]


def refusal_text(host: str, checks: list[Check]) -> str:
    """The failing checks as one message per check: what was found, then the fix."""
    return "\n".join(f"{host}: {c.name}: {c.detail}; fix: {c.fix}" for c in failing(checks))


def _used_gpus(profile: Profile | None, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs the server takes: CUDA_VISIBLE_DEVICES of the profile's env when it names
    indexes, else the first server.tp (no profile: all of them)."""
    if profile is None:
        return found
    visible = profile.model.env.get("CUDA_VISIBLE_DEVICES", "")
    wanted = [int(i) for i in visible.split(",") if i.strip().isdigit()]
    by_index = {g.get("index"): g for g in found}
    if wanted:
        return [by_index[i] for i in wanted if i in by_index]
    return found[:profile.model.server.gpus_per_node]


def gpus(profile: Profile | None, src: _Sources | None, facts: dict[str, Any]) -> Check:
    found = facts.get("gpus") or []
    errors = [g["error"] for g in found if "error" in g]
    if errors:
        return Check("gpus", FAIL, f"nvidia-smi failed: {errors[0]}", "check the NVIDIA driver: `nvidia-smi` "
                     "must list the GPUs (`sglfleet run HOST nvidia-smi` shows its whole answer)")
    if not found:
        return Check("gpus", FAIL, "no NVIDIA GPU visible (nvidia-smi missing or listing none)",
                     "install the NVIDIA driver, or pass the GPUs into this container")
    server = profile.model.server if profile else None
    tp = server.gpus_per_node if server else 1  # a multi-node server's GPUs are spread over its nodes
    what = f"server.tp {server.tp}" + (f" x pp {server.pp} over {server.nodes} nodes: {tp} per node"
                                       if server and (server.nodes > 1 or server.pp > 1) else "") if server else ""
    used = _used_gpus(profile, found)
    names = ", ".join(sorted({str(g.get("name")) for g in found}))
    if profile and src and len(used) < tp:
        return Check("gpus", FAIL, f"{len(used)} usable GPU(s) ({names}) for {what} ({src('server', 'tp')})",
                     f"lower server.tp to {len(used)}, fix CUDA_VISIBLE_DEVICES in env, or use a host with {tp} GPUs")
    return Check("gpus", OK, f"{len(found)} x {names}" + (f"; {what}" if profile else ""))


def gpu_memory(profile: Profile, src: _Sources, facts: dict[str, Any]) -> Check:
    used = _used_gpus(profile, [g for g in facts.get("gpus") or [] if "error" not in g])
    if not used:
        return Check("gpu memory", SKIP, "no GPU")
    fraction = profile.model.server.mem_fraction
    said = f"server.mem_fraction {fraction} ({src('server', 'mem_fraction')})" if fraction else \
        f"server.mem_fraction unset (SGLang sizes it; checked against {UNSET_MEM_FRACTION})"
    fraction = fraction or UNSET_MEM_FRACTION
    short, shown = [], []
    for g in used:
        total, free = g.get("memory_total_mib") or g.get("memory_mib"), g.get("memory_free_mib")
        if total is None or free is None:
            return Check("gpu memory", WARN, f"GPU {g.get('index')}: free memory unknown (nvidia-smi's memory "
                         "query gave nothing)", "check `nvidia-smi --query-gpu=memory.free --format=csv`")
        need = int(fraction * total)
        shown.append(f"GPU {g['index']}: {free} of {total} MiB free")
        if free < need:
            short.append((g, free, total, need))
    if not short:
        return Check("gpu memory", OK, "; ".join(shown) + f"; {said}")
    ours = (facts.get("port") or {}).get("ours")
    g, free, total, need = short[0]
    detail = (f"GPU {g['index']}: {free} MiB free of {total} MiB; {said} needs {need} MiB"
              + (f" on each of {len(short)} GPU(s)" if len(short) > 1 else ""))
    if ours:  # our own running server holds it; a deploy stops it before starting the new one
        return Check("gpu memory", WARN, detail + f", while our own server (pid {ours}) runs",
                     "none if that server holds it: deploy stops it first; `sglfleet stop HOST` frees it")
    most = int(100 * min(f / t for _, f, t, _ in short)) / 100
    return Check("gpu memory", FAIL, detail,
                 "free the GPU (`nvidia-smi` lists the processes holding it)"
                 + (f" or lower server.mem_fraction to at most {most}" if most > 0 else ""))


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in str(text).split("."))
    except ValueError:
        return None


def cuda(facts: dict[str, Any]) -> Check:
    torch = facts.get("torch") or {}
    if not [g for g in facts.get("gpus") or [] if "error" not in g]:
        return Check("cuda", SKIP, "no GPU")
    if not torch.get("version"):
        return Check("cuda", FAIL, "torch is not installed for the host's python",
                     "install the torch SGLang pins into the configured interpreter")
    if not torch.get("cuda"):
        return Check("cuda", FAIL, f"torch {torch['version']} is a CPU build: SGLang cannot use the GPUs",
                     "install a CUDA build of torch (the one SGLang pins)")
    drv = facts.get("driver") or {}
    have, want = _version_tuple(drv.get("cuda")), _version_tuple(torch["cuda"])
    if have is None or want is None:
        return Check("cuda", WARN, f"the driver's CUDA version is unknown ({drv.get('error') or 'no banner'}); "
                     f"torch is built for CUDA {torch['cuda']}", "check `nvidia-smi`'s banner")
    if have < want:
        return Check("cuda", FAIL, f"driver {drv.get('version')} supports CUDA {drv['cuda']}, the host's torch "
                     f"{torch['version']} is built for CUDA {torch['cuda']}",
                     f"upgrade the NVIDIA driver to one for CUDA {torch['cuda']}, or install a torch built for "
                     f"CUDA {drv['cuda']} or older")
    return Check("cuda", OK, f"driver {drv.get('version')} (CUDA {drv['cuda']}) >= torch's CUDA {torch['cuda']}")


def _dir_facts(what: str, path: str, source: str, found: dict[str, Any] | None, host: Host) -> Check | None:
    """The failures a model directory shares with the draft's; None: it is there and readable."""
    if not found or not found.get("exists"):
        return Check(what, FAIL, f"{path} does not exist on the host (from {source})",
                     f"copy it there, or fix the path (SGLang would read a missing path as a Hugging Face repo id)")
    if found.get("config_error"):
        return Check(what, FAIL, f"{path}/config.json: {found['config_error']}",
                     "the directory needs the model's config.json")
    if not found.get("architectures"):
        return Check(what, FAIL, f"{path}/config.json names no architectures", "use the model's own config.json")
    if not found.get("weight_files") and sglang_launcher(host):
        return Check(what, FAIL, f"{path}: no weight files ({_size(found)}; config only)", WEIGHTS_NEEDED)
    return None


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / MiB:.1f} MiB"


def _size(found: dict[str, Any]) -> str:
    return _bytes(found.get("bytes")) + (", counting stopped" if found.get("truncated") else "")


def model(host: Host, profile: Profile, src: _Sources, facts: dict[str, Any]) -> Check:
    p = profile.model
    if p.model is None:
        return Check("model", SKIP, "the profile has no model section")
    found = facts.get("model") or {}
    bad = _dir_facts("model", p.model.path, src("model", "path"), found, host)
    if bad:
        return bad
    arch = found["architectures"][0]
    kind = f"hybrid ({found.get('recurrent_layers')} linear-attention layers)" if found.get("hybrid") else "not hybrid"
    detail = f"{arch}, {kind}, {_size(found)}, {found.get('weight_files') or 0} weight file(s)"
    where = src("hybrid")
    if p.hybrid == "on" and not found.get("hybrid"):
        return Check("model", FAIL, f"{detail}; hybrid: on ({where}) adds the mamba cache flags, which SGLang's "
                     f"validation rejects for {arch}", "set hybrid: auto, or point model.path at a hybrid model")
    if p.hybrid == "off" and found.get("hybrid"):
        algorithm = p.speculative.algorithm if p.speculative else None
        if algorithm == "DDTREE":
            return Check("model", FAIL, f"{detail}; hybrid: off ({where}), but DDTREE refuses a hybrid target "
                         "without --speculative-ddtree-allow-hybrid-unsafe and the extra_buffer cache",
                         "set hybrid: auto")
        return Check("model", WARN, f"{detail}; hybrid: off ({where}) on a hybrid model",
                     "set hybrid: auto unless you chose SGLang's own mamba defaults on purpose")
    return Check("model", OK, detail + ("" if found.get("weight_files") else " (config only: enough for a stand-in)"))


def draft(host: Host, profile: Profile, src: _Sources, facts: dict[str, Any]) -> Check:
    spec = profile.model.speculative
    if spec is None:
        return Check("draft", SKIP, "no speculative section")
    found = facts.get("draft") or {}
    bad = _dir_facts("draft", spec.draft_model, src("speculative", "draft_model"), found, host)
    if bad:
        return bad
    arch, block = found["architectures"][0], found.get("block_size")
    detail = f"{arch}, block size {block}, {_size(found)}"
    if block is None:
        return Check("draft", FAIL, f"{arch} declares no block_size: not a DFlash draft, which {spec.algorithm} "
                     "drafts with", "point speculative.draft_model at a DFlash draft")
    if spec.block_size is not None and spec.block_size != block:
        return Check("draft", FAIL, f"{detail}; speculative.block_size is {spec.block_size} "
                     f"({src('speculative', 'block_size')})",
                     f"set speculative.block_size: {block} (or leave it out: the draft's is used)")
    return Check("draft", OK, detail)


def disk(facts: dict[str, Any]) -> Check:
    found = facts.get("disk") or {}
    shown, short = [], []
    for label, need in MIN_FREE.items():
        d = found.get(label)
        if not d or "free_bytes" not in d:
            short.append(f"{label} ({DISK_PATHS[label]}): not measured")
            continue
        text = f"{label} {d['path']}: {_bytes(d['free_bytes'])} free"
        shown.append(text)
        if d["free_bytes"] < need:
            short.append(f"{text} (measured at {d['measured_at']}), needs {_bytes(need)}")
    if short:
        return Check("disk", FAIL, "; ".join(short), "free space there: old releases (`sglfleet releases HOST`, "
                     "`sglfleet rollback`), rotated logs under " + hostlib.LOG_DIR)
    return Check("disk", OK, "; ".join(shown))


def port(host: Host, profile: Profile, src: _Sources, facts: dict[str, Any]) -> Check:
    found = facts.get("port")
    if found is None:
        return Check("port", SKIP, "not measured")
    number, bind = profile.model.server.port, bind_of(host, profile)
    foreign = [h for h in found.get("foreign") or [] if clashes(h.get("address"), bind)]
    if foreign:
        h = foreign[0]
        who = f"pid {h['pid']} ({' '.join(h.get('cmdline') or ['?'])})" if h.get("pid") else \
            "a process this host cannot see (another pid namespace or container)"
        return Check("port", FAIL, f"{bind}:{number} ({src('server', 'port')}) is taken: {who} "
                     f"listens on {h.get('address')}",
                     f"stop that process, or give the server another port (server.port, or "
                     f"sglfleet_profile_overrides: {{{profile.name}: {{server: {{port: N}}}}}} for this host)")
    if found.get("ours"):
        return Check("port", OK, f"{bind}:{number}: held by our own server (pid {found['ours']})")
    return Check("port", OK, f"{bind}:{number} free")


def clock(facts: dict[str, Any]) -> Check:
    host_time, sent, answered = facts.get("clock"), facts.get("sent_at"), facts.get("answered_at")
    if host_time is None or sent is None or answered is None:
        return Check("clock", WARN, "the host's clock could not be read (`date +%s.%N`)", "check `date` on the host")
    skew, spread = host_time - (sent + answered) / 2, (answered - sent) / 2
    detail = f"{abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} this machine (+-{spread:.1f} s)"
    if abs(skew) - spread > MAX_SKEW_S:
        return Check("clock", FAIL, detail, "sync the host's clock (`timedatectl set-ntp true`, or `chronyc "
                     "makestep`): `logs --since` and merged logs go by host time")
    return Check("clock", OK, detail)


def versions(artifacts: Artifacts, facts: dict[str, Any]) -> Check:
    py = facts.get("python") or {}
    if py.get("missing"):
        return Check("versions", FAIL, f"the configured interpreter is missing (python3 {py.get('version')} ran "
                     "instead)", "set ansible_python_interpreter to the python SGLang is installed for")
    package = facts.get("package") or {}
    have = {"python": py.get("version"), **(facts.get("distributions") or {})}
    patchset = artifacts.patchset
    name = patchset.manifest.package if patchset else "sglang"
    have[name] = package.get("version")
    shown = ", ".join(f"{k} {v or 'missing'}" for k, v in have.items())
    if not package:
        return Check("versions", FAIL, f"{name} is not importable by {py.get('executable')} ({shown})",
                     f"install {name} into that interpreter, or set ansible_python_interpreter to the one that has it")
    if patchset is None:
        return Check("versions", OK, f"{shown} (no patchset: nothing pinned)")
    mismatches = patchset.pin_mismatches(have)
    if mismatches:
        pins = {name: patchset.manifest.versions, **patchset.manifest.requires}
        wanted = " ".join(f"'{k}{v}'" for k, v in pins.items() if k != "python")
        return Check("versions", FAIL, "; ".join(mismatches) + f" for {py.get('executable')}",
                     f"install what patchset {patchset.name} pins: {py.get('executable')} -m pip install {wanted}"
                     + (f" (python {pins['python']})" if "python" in pins else "")
                     + ", or use a patchset made for this host's versions")
    return Check("versions", OK, f"{shown}: within patchset {patchset.name}'s pins")


def extension(host: Host, profile: Profile, artifacts: Artifacts, facts: dict[str, Any]) -> Check:
    if profile.model.artifacts.extension is None:
        return Check("extension", SKIP, "the profile deploys no extension")
    if not (facts.get("python") or {}).get("tag"):
        return Check("extension", SKIP, "the host's python is unknown")
    inspected = {"python": facts["python"], "torch": facts.get("torch") or {},
                 "gpus": [g for g in facts.get("gpus") or [] if g.get("arch")]}
    chosen = kernels.artifacts_for_host(profile, artifacts, inspected).extension
    host_fp = kernels.key(kernels.host_fingerprint(inspected))
    if chosen is None:
        return Check("extension", WARN, f"no build of the DDTree extension (this host: {host_fp}); the tree "
                     "utilities fall back to the reference", f"`sglfleet build-kernels {host.name}`")
    why = chosen.mismatches(inspected)
    if why:
        return Check("extension", FAIL, f"{chosen.directory} does not load here: {'; '.join(why)}",
                     f"`sglfleet build-kernels {host.name}` builds one for this host's fingerprint ({host_fp})")
    return Check("extension", OK, f"{chosen.directory} ({kernels.key(chosen.fingerprint)}) matches this host")


def worker_refusal(host: Host, profile: Profile, artifacts: Artifacts) -> str | None:
    """Why this host cannot serve the profile's algorithm from its patchset (None: it can, or
    the patchset does not say): an algorithm SGLang lacks, on SGLang's own launcher, from a
    patchset whose `provides:` has no worker."""
    spec, patchset = profile.model.speculative, artifacts.patchset
    if spec is None or patchset is None or patchset.serves(spec.algorithm) is not False or not sglang_launcher(host):
        return None
    provides = ", ".join(patchset.manifest.provides or []) or "nothing"
    return (f"{spec.algorithm} needs a speculative worker, and patchset {patchset.name} provides only {provides} "
            f"({patchset.directory / 'patchset.yaml'}: provides): SGLang's own launcher on {host.name} would fail "
            f"at start. Ship your own worker files as a patchset: `sglfleet patchset init --from YOUR-EDITS/ "
            f"--against {host.name}` writes one from your edited SGLang files; add `worker` to its provides: "
            "and point the profile's artifacts.patchset at it")


def unserved(host: Host, profile: Profile, artifacts: Artifacts, inventory_path: str) -> str | None:
    """worker_refusal for the profile as this host runs it (its overrides applied): `plan`'s check."""
    return worker_refusal(host, host_profile(host, profile, inventory_path)[0], artifacts)


def worker(host: Host, profile: Profile, artifacts: Artifacts) -> Check:
    spec, patchset = profile.model.speculative, artifacts.patchset
    if spec is None or spec.algorithm not in ALGORITHMS_NEEDING_A_WORKER:
        return Check("worker", SKIP, "SGLang has the algorithm itself" if spec else "no speculative section")
    if patchset is None:
        return Check("worker", SKIP, f"no patchset: {spec.algorithm} must come from the host's SGLang (smoke checks it)")
    refusal = worker_refusal(host, profile, artifacts)
    if refusal:
        what, _, fix = refusal.partition(". Ship")
        return Check("worker", FAIL, what, "ship" + fix)
    if patchset.serves(spec.algorithm) is None:
        return Check("worker", WARN, f"patchset {patchset.name} does not say whether it provides a "
                     f"{spec.algorithm} worker", "list what it provides in patchset.yaml (provides: [..., worker])")
    if not patchset.serves(spec.algorithm):
        return Check("worker", OK, f"patchset {patchset.name} has no {spec.algorithm} worker; this host runs "
                     "a stand-in (sglfleet_server_command), not SGLang's own launcher")
    return Check("worker", OK, f"patchset {patchset.name} provides the {spec.algorithm} worker")
