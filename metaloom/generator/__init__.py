"""Generators: the `Generator` protocol strategies are written against, its request and
result types, and the local engine.

Importing this package (or `metaloom.generator.types`) does not import torch: strategies,
the server's request handling and remote generators use the types without the engine.
`LocalGenerator` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaloom.generator.capabilities import Capabilities
from metaloom.generator.types import Completion, Generator, Request, Scored, StreamChunk, TokenIds

if TYPE_CHECKING:
    from metaloom.generator.local import LocalGenerator


def __getattr__(name: str) -> Any:
    if name == "LocalGenerator":
        from metaloom.generator.local import LocalGenerator

        return LocalGenerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Capabilities", "Completion", "Generator", "LocalGenerator", "Request", "Scored", "StreamChunk", "TokenIds"]
