"""Sandboxed execution of untrusted Python for verifiers (see `metaloom.sandbox.run` for the
isolation each mode gives and its limits; the weak ``hook`` mode runs only on opt-in)."""

from metaloom.sandbox.run import (
    NETWORK_MODES,
    STATUSES,
    WEAK_ENV,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    namespaces_available,
    resolve_mode,
    run_python,
    weak_opted_in,
)

__all__ = [
    "NETWORK_MODES",
    "STATUSES",
    "WEAK_ENV",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "namespaces_available",
    "resolve_mode",
    "run_python",
    "weak_opted_in",
]
