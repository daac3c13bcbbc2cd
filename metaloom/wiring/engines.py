"""The engines a command or an evaluation runs on: a remote OpenAI-compatible server
(``--backend openai``) and the local engine's radix prefix cache. One place for both, so that
`metaloom run`, `metaloom serve` and `metaloom eval` build them alike from plain settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaloom.errors import InvalidParameter

if TYPE_CHECKING:
    from metaloom.generator.remote import RemoteGenerator
    from metaloom.prefix import PrefixCache


def remote_generator(base_url: str | None, model: str, *, api_key: str | None = None, tokenizer: str | None = None,
                     model_params: float | None = None, max_concurrency: int = 16, timeout: float = 600.0,
                     max_retries: int = 3) -> RemoteGenerator:
    """A `RemoteGenerator` on ``base_url`` (required: the server's URL)."""
    if not base_url:
        raise InvalidParameter("base-url", base_url, "the server's URL with --backend openai (e.g. http://127.0.0.1:8000)")
    from metaloom.generator.remote import RemoteGenerator

    return RemoteGenerator(base_url, model, api_key=api_key, tokenizer=tokenizer, model_params=model_params,
                           max_concurrency=max_concurrency, timeout=timeout, max_retries=max_retries)


def prefix_cache(megabytes: int, loaded: Any) -> PrefixCache | None:
    """The radix prefix cache kept across a strategy's calls, or None (0 megabytes, no model
    yet: only the value is checked, or a model without the native KV pool)."""
    from metaloom.prefix import PrefixCache

    if not isinstance(megabytes, int) or isinstance(megabytes, bool) or megabytes < 0:
        raise InvalidParameter("prefix_cache_mb", megabytes, "a number of megabytes >= 0 (0 turns the cache off)")
    if megabytes == 0 or loaded is None or not hasattr(loaded.model, "new_pool"):
        return None
    return PrefixCache(budget_bytes=megabytes << 20)
