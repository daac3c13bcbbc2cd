"""`metaloom serve`: an OpenAI-compatible server on the engine (continuous batching, strategies per request)."""
