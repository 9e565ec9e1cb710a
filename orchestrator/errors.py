"""Error types. Each one renders as a single clear paragraph for the CLI."""

from __future__ import annotations


class SglfleetError(Exception):
    """Base for errors we expect and explain (never shown as a traceback)."""

    exit_code = 1


class ConfigError(SglfleetError):
    """Bad user input: inventory, pattern, profile. Exit code 2."""

    exit_code = 2

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


class LoopbackOnlyError(SglfleetError):
    """Raised before any packet is sent to a non-loopback target."""


class HostKeyError(SglfleetError):
    """Unknown or changed host key under the configured policy."""


class ConnectError(SglfleetError):
    """The host could not be reached or authentication failed."""


class RemoteError(SglfleetError):
    """A remote script failed: its own explanation (a refusal) or an exception, whole.

    `error_type`, `remote_traceback` and `detail` are what the host reported (see
    remote/hostlib.serve); `exit_status` is the remote process's exit status."""

    def __init__(self, message: str, error_type: str = "Failure", remote_traceback: str | None = None,
                 detail: dict | None = None, exit_status: int | None = None):
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback
        self.detail = detail or {}
        self.exit_status = exit_status
