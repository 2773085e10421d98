"""PEFT LoRA adapters made offline for tests, and the HF + PEFT reference they are held to.

Adapters are written by ``peft`` itself (``adapter_config.json`` + safetensors) on a base
checkpoint, with random A and B (PEFT's default B is zero, which would leave the base
model's output unchanged and prove nothing).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import torch

from sglang_hf_backend.testing.engines import GREEDY, NEW_TOKENS, prompt_ids, running_engine

# adapter name -> PEFT target modules, by HF naming: "attention" leaves k_proj out (a fused
# q/k/v layer gets zeros for it); GPT-2's bare "c_proj" is in attention and in the MLP
ADAPTER_TARGETS = {
    "attention": ["q_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj", "k_proj"],
}
GPT2_ADAPTER_TARGETS = {"attention": ["c_attn", "c_proj"], "mlp": ["c_fc", "mlp.c_proj"]}


def adapter_targets(model: str) -> dict[str, list[str]]:
    return GPT2_ADAPTER_TARGETS if model == "gpt2" else ADAPTER_TARGETS


RANK = 8
LORA_SCALE = 0.1  # std of the random A/B entries: large enough to change greedy tokens


def build_adapter(base: Path, out_dir: Path, targets: list[str], rank: int = RANK, seed: int = 0) -> Path:
    """Write a PEFT LoRA adapter for ``base`` with random weights on ``targets``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_SCALE)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


@lru_cache(maxsize=None)
def _hf_with_adapter(base: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    return (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()


def hf_lora_greedy(base: Path, adapter: Path | None, ids: list[int]) -> list[int]:
    """New tokens from HF ``generate`` with the adapter applied by PEFT (fp32, greedy)."""
    model = _hf_with_adapter(str(base), str(adapter) if adapter else None)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


@dataclasses.dataclass
class LoRACase:
    """One engine serving several adapters: per-prompt adapters, HF + PEFT references."""

    adapters: list[str | None]  # the adapter name each prompt was sent with
    reference: list[list[int]]
    base_reference: list[list[int]]  # HF without any adapter, to show the adapters matter
    batched: list[list[int]]
    one_at_a_time: list[list[int]]


def lora_case(base: Path, adapters: dict[str, Path], per_prompt: list[str | None], **options) -> LoRACase:
    """Serve ``adapters`` on ``base`` and send prompt i with adapter ``per_prompt[i]``."""
    ids = prompt_ids(base)[: len(per_prompt)]
    reference = [hf_lora_greedy(base, adapters.get(a) if a else None, p) for a, p in zip(per_prompt, ids)]
    base_reference = [hf_lora_greedy(base, None, p) for p in ids]
    paths = {name: str(path) for name, path in adapters.items()}
    with running_engine(base, enable_lora=True, lora_paths=paths, **options) as running:
        engine = running.engine
        outs = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path=per_prompt)
        batched = [o["output_ids"] for o in outs]
        single = [
            engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=a)["output_ids"]
            for a, p in zip(per_prompt, ids)
        ]
    return LoRACase(per_prompt, reference, base_reference, batched, single)
