"""Sampling: validated parameters and the one ordered logits pipeline."""

from metaloom.sampling.params import SamplingParams
from metaloom.sampling.pipeline import Sampler, make_sampler
from metaloom.sampling.state import SamplingState

__all__ = ["Sampler", "SamplingParams", "SamplingState", "make_sampler"]
