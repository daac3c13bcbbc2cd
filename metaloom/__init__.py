"""metaloom: make a language model better and faster at inference time."""

__version__ = "0.1.0"
