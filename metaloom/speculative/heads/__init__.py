"""Speculator heads (Medusa-style, hierarchical): model, training data, training, shipped files.

The drafter that uses them is `metaloom.speculative.drafters.heads.HeadsDrafter`; the command
that trains them is ``metaloom train-speculator``."""

from metaloom.speculative.heads.model import HeadsConfig, SpeculatorHeads, load_heads, save_heads
from metaloom.speculative.heads.shipped import DEFAULT_FILE, shipped_heads

__all__ = ["DEFAULT_FILE", "HeadsConfig", "SpeculatorHeads", "load_heads", "save_heads", "shipped_heads"]
