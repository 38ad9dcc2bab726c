"""Errors that carry the CLI exit code of docs/design.md section 3."""


class BitnetError(Exception):
    """Base of every error the CLI turns into one line on stderr."""

    exit_code = 1


class UsageError(BitnetError):
    exit_code = 2


class NoBackendError(BitnetError):
    """No backend satisfies the request (or a fake device was asked to compute)."""

    exit_code = 3


class ModelError(BitnetError):
    """The model file is invalid or unsupported."""

    exit_code = 4


class GateError(BitnetError):
    """A gate or threshold failed (bench, receipt verification)."""

    exit_code = 5


class PluginError(BitnetError):
    """A plugin could not be loaded or conflicts with another (strict mode, duplicates)."""

    exit_code = 1


def is_ctrl_c(exc: BaseException | None) -> bool:
    """A KeyboardInterrupt, or a SystemError("... returned a result with an exception set") caused by one,
    however deep: Ctrl-C landing inside a C call that then returns a value (numba's dispatch nests them)."""
    while isinstance(exc, SystemError):
        exc = exc.__cause__
    return isinstance(exc, KeyboardInterrupt)
