"""The one redaction policy: what counts as a secret, and how it is hidden, for everything that
leaves a host or is stored or printed by the controller (bundles, runs/ records, status, render,
deploy output and --json).

A secret is
  - the value of an environment variable whose name looks secret (TOKEN, SECRET, PASSWORD,
    API_KEY, ACCESS_KEY, PRIVATE, CREDENTIAL, ... anywhere in the name);
  - the value of a command-line flag whose name looks secret: `--api-key`, `--admin-api-key`,
    `--hf-token`, and any `--*-key`, `--*-token`, `--*-secret`, `--*-password` (as `--flag VALUE`
    or `--flag=VALUE`);
  - any text of the form of an API token: `sk-...` (OpenAI style), `hf_...` (Hugging Face).

Structured places (an argv, an env mapping, an env file) keep the name and lose the value:
`<redacted by sglfleet: N characters>`. Free text (a launch script, a unit, a record, a log)
loses every occurrence of the secret values found in the deployment's argv and env, quoted or
not, and every token-shaped text. Streams (logs of any size) are masked in place with a mask of
the same length, so a file's size, and a tar member's, stays what it was.

Stdlib only, Python 3.8+: sent to hosts with the bundle call (a companion script) and imported
by the controller.
"""

import re
import shlex

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL)",
                         re.I)
SECRET_FLAG = re.compile(r"--(?:[A-Za-z0-9]+[-_])*(?:key|token|secret|password|passwd|passphrase)", re.I)
TOKEN = re.compile(r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_\-]{8,256}|hf_[A-Za-z0-9]{20,256})")
SHORTEST = 4  # a shorter value is hidden where it stands (argv, env) but not searched for in text
OVERLAP = 4096  # a stream keeps this much back between chunks: longer than any secret searched for


def marker(value):
    return "<redacted by sglfleet: %d characters>" % len(value)


def secret_flag(arg):
    """True for a flag whose value is secret (`--api-key` or `--api-key=...`)."""
    return bool(SECRET_FLAG.fullmatch(arg.split("=", 1)[0])) if arg.startswith("--") else False


def argv(args):
    """An argv with every secret flag's value (and every token-shaped text) replaced."""
    out, hide_next = [], False
    for arg in [str(a) for a in args]:
        if hide_next:
            hide_next = False
            if not arg.startswith("--"):
                out.append(marker(arg))
                continue
        if secret_flag(arg):
            name, eq, value = arg.partition("=")
            if eq:
                out.append(name + "=" + marker(value))
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(TOKEN.sub(lambda m: marker(m.group()), arg))
    return out


def env(mapping):
    """An environment with the values of secret-named keys (and token-shaped text) replaced."""
    return {k: marker(str(v)) if SECRET_NAME.search(str(k)) else TOKEN.sub(lambda m: marker(m.group()), str(v))
            for k, v in (mapping or {}).items()}


def secret_values(args=(), environment=None):
    """The secret values of an argv and an environment: what free text must not show."""
    found, hide_next = set(), False
    for arg in [str(a) for a in args or ()]:
        if hide_next:
            hide_next = False
            if not arg.startswith("--"):
                found.add(arg)
                continue
        if secret_flag(arg):
            name, eq, value = arg.partition("=")
            if eq:
                found.add(value)
            else:
                hide_next = True
        found.update(TOKEN.findall(arg))
    for key, value in (environment or {}).items():
        if SECRET_NAME.search(str(key)):
            found.add(str(value))
        found.update(TOKEN.findall(str(value)))
    return sorted((v for v in found if len(v) >= SHORTEST), key=len, reverse=True)


def env_file_values(text):
    """The environment an env file (KEY=value lines, values shell-quoted) sets."""
    out = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export "):].strip()
        if not eq or not key or key.startswith("#"):
            continue
        try:
            parts = shlex.split(value)
        except ValueError:
            parts = [value]
        out[key] = parts[0] if len(parts) == 1 else value
    return out


def env_text(text):
    """An env file's text: KEY=value lines whose key looks secret keep the key, lose the value."""
    out = []
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        bare = key.strip()
        if bare.startswith("export "):
            bare = bare[len("export "):].strip()
        if eq and SECRET_NAME.search(bare):
            out.append("%s=%s" % (key, marker(value)))
        else:
            out.append(TOKEN.sub(lambda m: marker(m.group()), line))
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _forms(values):
    """Each secret as free text may hold it: as is, shell-quoted, JSON- and systemd-escaped."""
    forms = set()
    for value in values:
        forms.update((value, shlex.quote(value), value.replace("\\", "\\\\").replace('"', '\\"'),
                      value.replace("%", "%%").replace("$", "$$")))
    return sorted((f for f in forms if len(f) >= SHORTEST), key=len, reverse=True)


def text(value, values=()):
    """Free text with every secret value (any form of it) and every token-shaped text replaced."""
    for form in _forms(values) if values else ():
        if form in value:
            value = value.replace(form, marker(form))
    if "sk-" not in value and "hf_" not in value:  # what TOKEN needs, found much faster
        return value
    return TOKEN.sub(lambda m: marker(m.group()), value)


def document(node, values=()):
    """A JSON document with every string through `text`, argv lists (under keys argv, command,
    cmdline, values) through `argv` and env mappings (key env) through `env`."""
    if isinstance(node, dict):
        out = {}
        for key, item in node.items():
            if key in ("argv", "command", "cmdline") and isinstance(item, list):
                out[key] = [text(a, values) for a in argv(item)]
            elif key == "env" and isinstance(item, dict):
                out[key] = {k: text(v, values) for k, v in env(item).items()}
            else:
                out[key] = document(item, values)
        return out
    if isinstance(node, list):
        return argv(node) if any(isinstance(a, str) and secret_flag(a) for a in node) else \
            [document(item, values) for item in node]
    if isinstance(node, str):
        return text(node, values)
    return node


def values_in(node, found=None):
    """The secret values a JSON document carries: in its argv lists and env mappings."""
    found = set() if found is None else found
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("argv", "command", "cmdline") and isinstance(item, list):
                found.update(secret_values(item))
            elif key == "env" and isinstance(item, dict):
                found.update(secret_values((), item))
            else:
                values_in(item, found)
    elif isinstance(node, list):
        if any(isinstance(a, str) and secret_flag(a) for a in node):
            found.update(secret_values(node))
        for item in node:
            values_in(item, found)
    return found


# The secrets this controller process has seen (every rendered argv and env, every deployment
# record read): whatever it prints or stores is scrubbed of them.
KNOWN = set()


def remember(args=(), environment=None):
    KNOWN.update(secret_values(args, environment))


def scrub(node):
    """A JSON document with its own secrets and every KNOWN one redacted (`document`)."""
    return document(node, sorted(values_in(node) | KNOWN, key=len, reverse=True))


def mask(length):
    """A same-length stand-in for a secret in a stream."""
    return ("<redacted" + "." * max(0, length - 10) + ">")[:length] if length >= 10 else "*" * length


class StreamMask:
    """Bytes through `feed` come out with every secret value and token-shaped text masked in
    place (same length); OVERLAP bytes are held back so a secret split between two chunks is
    still found. `finish` gives what is held."""

    def __init__(self, values=()):
        self.literals = [v.encode("utf-8", "surrogateescape") for v in _forms(values)]
        self.tokens = re.compile(TOKEN.pattern.encode())
        self.held = b""

    def _masked(self, data, final):
        for literal in self.literals:
            if literal in data:
                data = data.replace(literal, mask(len(literal)).encode())
        cut = len(data) if final else max(0, len(data) - OVERLAP)
        pieces, at = [], 0
        for match in self.tokens.finditer(data):
            if not final and match.end() == len(data):  # it may go on in the next chunk
                cut = min(cut, match.start())
                break
            pieces += [data[at:match.start()], mask(match.end() - match.start()).encode()]
            at = match.end()
        data = b"".join(pieces) + data[at:]
        return data[:cut], data[cut:]

    def feed(self, chunk):
        out, self.held = self._masked(self.held + chunk, False)
        return out

    def finish(self):
        out, self.held = self._masked(self.held, True)[0], b""
        return out


def cmd_scrub(args, stream=None):
    """A document as the policy leaves it (`python -m orchestrator.remote.redact scrub JSON`)."""
    return scrub(args.get("document"))


COMMANDS = {"scrub": cmd_scrub}

if __name__ == "__main__":
    try:
        import sglfleet_hostlib as hostlib
    except ImportError:
        from orchestrator.remote import hostlib
    raise SystemExit(hostlib.main(COMMANDS))
