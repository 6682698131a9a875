"""Rollout: the built-in generation engine (engine.Engine, sampling.SamplingParams)."""
from hybridengine.rollout.engine import Engine, GenerationResult
from hybridengine.rollout.sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams"]
