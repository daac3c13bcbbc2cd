"""Program-aided reasoning (Gao et al. 2023, PAL; Chen et al. 2023, Program of Thoughts): the
model writes a Python program, metaloom's sandbox runs it (`metaloom.sandbox.run`: no network,
no files outside its folder, a wall-time limit), and what it printed is the observation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.sandbox import SandboxLimits, resolve_mode, run_python
from metaloom.tools.base import string_argument

SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"],
          "additionalProperties": False}
MAX_OUTPUT_CHARS = 4000  # the end of what it printed: where a result usually is


def _tail(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


@dataclass(frozen=True)
class PythonTool:
    """Run a Python program in the sandbox; its standard output is the result.

    A program that fails (an exception, the time or memory limit) gives what it printed and
    then ``Error (<status>): <failure>``; this is an observation, not an exception, so the
    model can correct its code."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    name: str = "python"
    description: str = "Runs a Python program and returns what it prints (use print for the result)."
    schema: Mapping[str, Any] = field(default_factory=lambda: SCHEMA)

    @classmethod
    def checked(cls, timeout_s: float) -> PythonTool:
        """The tool with a ``timeout_s`` limit, after checking that the sandbox can isolate code
        here: `SandboxUnavailable` (a typed error, before any model call) rather than the
        same refusal as the observation of every call."""
        limits = SandboxLimits(timeout_s=timeout_s)
        resolve_mode(limits.network, allow_weak=limits.allow_weak)
        return cls(limits)

    def call(self, arguments: Mapping[str, Any]) -> str:
        result = run_python(string_argument(arguments, "code"), limits=self.limits)
        out = result.stdout.rstrip("\n")
        if result.passed:
            return _tail(out) if out else "(the program printed nothing; print the result)"
        error = f"Error ({result.status}): {result.failure.strip()}"
        return _tail(f"{out}\n{error}" if out else error)
