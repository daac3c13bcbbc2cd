"""Sampling: validated parameters and the one ordered logits pipeline."""

from metaloom.sampling.params import SamplingParams
from metaloom.sampling.pipeline import Sampler, make_sampler

__all__ = ["Sampler", "SamplingParams", "make_sampler"]
