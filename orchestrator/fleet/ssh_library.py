"""paramiko, imported without invoke: every sglfleet module takes paramiko from here.

paramiko.config imports invoke (when installed; paramiko 4 requires it) for one thing: running
`Match exec` in paramiko's own ssh config parser. sglfleet never uses that parser (OpenSSH's
`ssh -G` resolves the config, fleet/ssh_resolve.py), and importing invoke costs ~40 ms of CPU
(a third of paramiko's import: unittest.mock, asyncio, a vendored yaml) on every command. So the
first import of paramiko sees invoke as absent, exactly as paramiko handles a machine without it
(its SSHConfig then refuses `Match exec` with the ImportError); invoke itself stays importable.
"""

from __future__ import annotations

import sys

if "paramiko" in sys.modules or "invoke" in sys.modules:
    import paramiko
else:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
    try:
        import paramiko
    finally:
        del sys.modules["invoke"]

__all__ = ["paramiko"]
