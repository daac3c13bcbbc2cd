"""Scoring: scorers, step scorers, utilities, answer extraction, sandboxed execution."""
