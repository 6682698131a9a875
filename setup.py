from setuptools import find_packages, setup

setup(
    name="hybridengine",
    version="0.1.0",
    description="Megatron-style 3D-parallel engine for RL post-training of LLMs (PPO, GRPO, DAPO)",
    packages=find_packages(include=["hybridengine", "hybridengine.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "omegaconf>=2.3",
        "pyarrow>=14",
        "pandas>=2",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=8"],
        "vllm": ["vllm>=0.11"],
    },
    package_data={"hybridengine": ["../configs/*.yaml"]},
)
