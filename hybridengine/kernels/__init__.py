"""Python front of csrc/: fused ops with a CUDA implementation (JIT-built on first use) and a
torch fallback that computes the same results on any device."""
from hybridengine.kernels.logprob import cuda_extension, fused_linear_logprob_entropy

__all__ = ["cuda_extension", "fused_linear_logprob_entropy"]
