"""Sandboxed execution of untrusted Python for verifiers (see `metaloom.sandbox.run` for the
isolation each mode gives and its limits)."""

from metaloom.sandbox.run import (
    NETWORK_MODES,
    STATUSES,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    namespaces_available,
    resolve_mode,
    run_python,
)

__all__ = [
    "NETWORK_MODES",
    "STATUSES",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "namespaces_available",
    "resolve_mode",
    "run_python",
]
