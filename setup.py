from setuptools import find_packages, setup

setup(
    name="megatron-sft-engine",
    version="0.1.0",
    description="Megatron-Core engine for SFT and RL (GRPO/DAPO) whose loss does not depend on "
                "the parallel layout",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "models", "models.*", "parallel", "parallel.*"]),
    install_requires=[
        "torch>=2.4",
        # Tested: 0.16.1 (full suite) and the newest 0.19.x (.ci/run's second run); 0.17.1 and
        # 0.18.2 passed the same subset. Releases from 0.17 declare Requires-Python >= 3.12, so
        # on Python 3.10/3.11 pip resolves 0.16.1 and keeps a 0.17-0.19 installed by hand
        # (README: "Tested Megatron-Core versions").
        "megatron-core>=0.16.1,<0.20",
        # megatron-core >= 0.18 imports triton when its pipeline schedules load (MoE paged
        # stash) without declaring it; CUDA torch wheels bring it, CPU torch wheels do not.
        "triton; sys_platform == 'linux' and python_version >= '3.12'",
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
        # datasets: the save_to_disk format is tested with the real library
        "test": ["pytest>=7.4", "pytest-timeout>=2.2", "tokenizers>=0.19", "matplotlib>=3.7",
                 "datasets>=2.14", "peft"],
        # flash-linear-attention: the gated delta rule's CUDA kernel (Qwen3.5's GDN layers)
        "gpu": ["transformer-engine[pytorch]>=2.0", "sglang>=0.4", "flash-linear-attention"],
    },
)
