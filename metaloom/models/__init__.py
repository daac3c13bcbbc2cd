"""Models: protocols, the native Llama-family model, loading, and the transformers adapter."""

from metaloom.models.load import LoadedModel, load
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer

__all__ = ["KVCache", "LanguageModel", "LoadedModel", "Tokenizer", "load"]
