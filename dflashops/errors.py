"""Exit codes of the contract and the errors that carry them to the command line."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_FOUND = 4
    INTERRUPTED = 130


class OpsError(Exception):
    """An error the user can act on: printed as one line, exits with `code`."""

    code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, code: ExitCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class UsageError(OpsError):
    code = ExitCode.USAGE


class InventoryError(UsageError):
    """A bad hosts.yaml: the message names file:line and the key."""


class UnreachableError(OpsError):
    code = ExitCode.UNREACHABLE


class HostKeyError(UnreachableError):
    """The host's key is not pinned, or does not match the pinned one."""


class NoAnswerError(UnreachableError):
    """Nothing came back within the deadline (`--timeout`): a hung command, a dead peer."""

    def __init__(self, who: str, seconds: float) -> None:
        super().__init__(f"{who}: no answer in {seconds:g} s")
        self.seconds = seconds


class ConnectionLostError(NoAnswerError):
    """The server sent nothing, not even an answer to a keepalive, for `seconds` (less than
    the command's deadline): the link is down, or the host off or frozen."""

    def __init__(self, who: str, seconds: float) -> None:
        UnreachableError.__init__(self, f"{who}: connection lost (no answer for {seconds:g} s)")
        self.seconds = seconds


class NotFoundError(OpsError):
    code = ExitCode.NOT_FOUND


class TransferError(OpsError):
    """A copy did not arrive intact (checksum mismatch, short write)."""
