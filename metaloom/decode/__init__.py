"""Decoding: plain functions over a model and its cache."""
