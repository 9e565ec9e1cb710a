"""Facts: tiny classes that know what to ask the host and how to read the answer.

All requested facts of a host travel in ONE round trip: their requests are the args of
`remote/gather_facts.py`'s `gather` command (fleet/remote_call.py), which answers every one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .inventory import Host
from .remote_call import call


class Fact:
    name: ClassVar[str]

    def request(self, host: Host) -> dict[str, Any]:
        """{"kind": "cmd", "args": argv} or {"kind": "py", "args": [probe, *args]}."""
        raise NotImplementedError

    def process(self, raw: Any, host: Host) -> Any:
        return raw


class Hostname(Fact):
    name = "hostname"

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["hostname"]}


class OsRelease(Fact):
    name = "os"

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["read_file", "/etc/os-release"]}

    def process(self, raw: dict[str, Any], host: Host) -> str:
        if not raw.get("exists"):
            return "unknown"
        fields = {}
        for line in raw["text"].splitlines():
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip().strip('"')
        return fields.get("PRETTY_NAME") or fields.get("NAME") or "unknown"


class Gpus(Fact):
    """nvidia-smi's listing, parsed on the host (remote/hostlib.gpus: the one parser)."""

    name = "gpus"

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["gpus"]}

    def process(self, raw: list[dict[str, Any]], host: Host) -> list[dict[str, Any]]:
        keep = ("index", "name", "memory_mib", "driver", "error")
        return [{k: g[k] for k in keep if k in g} for g in raw]


class Interpreter(Fact):
    name = "interpreter"

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["interpreter"]}

    def process(self, raw: dict[str, Any], host: Host) -> dict[str, Any]:
        return {"configured": host.python, "executable": raw.get("executable"),
                "version": raw.get("version"), "missing": bool(raw.get("missing"))}


class Packages(Fact):
    name = "packages"
    names: ClassVar[list[str]] = ["sglang", "torch"]

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["distributions", *self.names]}


class ModelsDisk(Fact):
    name = "models_disk"

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "py", "args": ["disk_free", host.models_dir]}


DEFAULT_FACTS: tuple[type[Fact], ...] = (Hostname, OsRelease, Interpreter, Packages, Gpus, ModelsDisk)


def gather(conn: Any, fact_types: tuple[type[Fact], ...] = DEFAULT_FACTS,
           timeout: float = 60) -> dict[str, Any]:
    """All facts of one host in one round trip."""
    facts = [t() for t in fact_types]
    requests = [{"name": fact.name, **fact.request(conn.host)} for fact in facts]
    raw = call(conn, "gather_facts.py", "gather", {"requests": requests}, timeout=timeout, fallback_python=True)
    values: dict[str, Any] = {}
    for fact in facts:
        item = raw.get(fact.name, {})
        if isinstance(item, dict) and "probe_error" in item:
            values[fact.name] = {"error": item["probe_error"]}
        else:
            values[fact.name] = fact.process(item, conn.host)
    return values
