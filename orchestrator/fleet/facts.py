"""Facts: tiny classes that know what to ask the host and how to read the answer.

All requested facts of a host travel in ONE round trip: their requests become the argv of
`remote/gather_facts.py` (sent over stdin), which answers with one Python literal.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, ClassVar

from ..errors import SglfleetError
from .inventory import Host
from .transport import Connection
from ..remote import REMOTE_DIR

GATHER_SCRIPT = REMOTE_DIR / "gather_facts.py"
_SEP = "\x1f"  # field separator inside one request argument (see gather_facts.py)


class Fact:
    name: ClassVar[str]

    def request(self, host: Host) -> dict[str, Any]:
        """{"kind": "cmd", "args": argv} or {"kind": "py", "args": [probe, *args]}."""
        raise NotImplementedError

    def process(self, raw: Any, host: Host) -> Any:
        return raw


class CommandFact(Fact):
    argv: ClassVar[list[str]]

    def request(self, host: Host) -> dict[str, Any]:
        return {"kind": "cmd", "args": list(self.argv)}

    def process(self, raw: dict[str, Any], host: Host) -> Any:
        if raw.get("rc") != 0:
            return None
        return self.parse(raw["stdout"])

    def parse(self, stdout: str) -> Any:
        return stdout.strip()


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


class Gpus(CommandFact):
    name = "gpus"
    argv = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader,nounits"]

    def process(self, raw: dict[str, Any], host: Host) -> list[dict[str, Any]]:
        if raw.get("rc") == 127:
            return []  # no nvidia-smi: no NVIDIA GPU on this host
        if raw.get("rc") != 0:
            return [{"error": (raw.get("stderr") or "nvidia-smi failed").strip()}]
        return self.parse(raw["stdout"])

    def parse(self, stdout: str) -> list[dict[str, Any]]:
        gpus = []
        for line in stdout.splitlines():
            cells = [c.strip() for c in line.split(",")]
            # Lines that are not CSV rows (a banner, a warning) are skipped, not guessed at.
            if len(cells) != 4 or not cells[0].isdigit():
                continue
            memory = int(cells[2]) if cells[2].isdigit() else None
            gpus.append({"index": int(cells[0]), "name": cells[1], "memory_mib": memory,
                         "driver": cells[3]})
        return gpus


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


def gather(conn: Connection, fact_types: tuple[type[Fact], ...] = DEFAULT_FACTS,
           timeout: float = 60) -> dict[str, Any]:
    """All facts of one host in one round trip."""
    facts = [t() for t in fact_types]
    argv = []
    for fact in facts:
        request = fact.request(conn.host)
        argv.append(_SEP.join([fact.name, request["kind"], *request["args"]]))
    result = conn.run_python(GATHER_SCRIPT, argv, timeout=timeout, fallback_python=True)
    if not result.ok:
        why = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        raise SglfleetError(f"{conn.host.name}: fact gathering failed ({why}):\n{result.stderr_text}")
    try:
        raw = ast.literal_eval(result.stdout_text)  # literals only: never evaluates code
    except (ValueError, SyntaxError, MemoryError):
        raise SglfleetError(f"{conn.host.name}: fact gathering printed no result:\n"
                            f"{result.stdout_text}\n{result.stderr_text}") from None
    values: dict[str, Any] = {}
    for fact in facts:
        item = raw.get(fact.name, {})
        if isinstance(item, dict) and "probe_error" in item:
            values[fact.name] = {"error": item["probe_error"]}
        else:
            values[fact.name] = fact.process(item, conn.host)
    return values
