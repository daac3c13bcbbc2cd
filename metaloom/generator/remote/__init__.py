"""A `Generator` over any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, metaloom
serve, OpenAI): `RemoteGenerator`. Strategies written against `metaloom.generator.Generator`
run on it unchanged; what the server cannot do is refused with `Unsupported` before anything is
sent (`ServerFeatures` records what start-up found).

Needs the ``openai`` package (a core dependency)."""

from metaloom.generator.remote.detect import ServerFeatures
from metaloom.generator.remote.generator import RemoteGenerator
from metaloom.generator.remote.transport import RetryPolicy

__all__ = ["RemoteGenerator", "RetryPolicy", "ServerFeatures"]
