from setuptools import setup

setup(
    name="megatron-sft-engine",
    version="0.1.0",
    description="Megatron-Core engine for SFT and RL (GRPO/DAPO) whose loss does not depend on "
                "the parallel layout",
    python_requires=">=3.10",
    packages=["engine", "engine.rl", "engine.rl.rollout", "models", "parallel"],
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17",
        "transformers>=4.51",
        "safetensors>=0.4",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3",
        "tensorboard>=2.14",
        "tqdm>=4.66",
        "psutil>=5.9",
        "numpy>=1.24",
        "pyarrow>=14",
    ],
    extras_require={
        "test": ["pytest>=7.4", "pytest-timeout>=2.2", "tokenizers>=0.19", "matplotlib>=3.7"],
        "gpu": ["transformer-engine[pytorch]>=2.0", "sglang>=0.4"],
    },
)
