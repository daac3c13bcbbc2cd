"""Toy models and scripted components that implement metaloom's real protocols, for tests."""
