"""sglang-hf-backend: serve any attention-interface Hugging Face model through SGLang."""

from setuptools import find_packages, setup

setup(
    name="sglang-hf-backend",
    version="0.1.0",
    description=(
        "SGLang plugin that serves Hugging Face transformers models with RadixAttention, "
        "tensor parallelism, automatic layer fusion and torchao quantization"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir={"": "python"},
    packages=find_packages("python"),
    # C++ kernels built on first use for the CPU they run on (cpu_kernels.py)
    package_data={"sglang_hf_backend": ["csrc/*.cpp"]},
    install_requires=[
        "sglang==0.5.23",
        "transformers==5.19.0",
        "torch==2.14.1",
        "torchao==0.18.0",
        "ninja==1.13.2",
    ],
    extras_require={
        # What a CUDA machine adds on top of the CPU stack (requirements/cpu.txt).
        "gpu": ["flashinfer-python==0.7.2", "sglang-kernel==0.4.10"],
    },
    entry_points={
        "sglang.srt.plugins": ["sglang_hf_backend = sglang_hf_backend.plugin:register"],
        "sglang.srt.platforms": ["sglang_hf_backend_cpu = sglang_hf_backend.platform:activate"],
    },
)
