"""hybridengine: a Megatron-style 3D-parallel engine for RL post-training of LLMs."""
__version__ = "0.1.0"
