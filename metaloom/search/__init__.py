"""Tree search over reasoning steps."""
