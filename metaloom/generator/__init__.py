"""Generators: the local engine and the request/completion types strategies use."""

from metaloom.generator.local import LocalGenerator
from metaloom.generator.types import Completion, Generator, Request, StreamChunk

__all__ = ["Completion", "Generator", "LocalGenerator", "Request", "StreamChunk"]
