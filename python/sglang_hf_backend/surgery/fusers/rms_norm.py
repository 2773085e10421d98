"""RMS norm modules -> SGLang ``RMSNorm`` / ``GemmaRMSNorm`` (which also fuse a residual add).

A module is an RMS norm if it behaves like one, not if it is named like one: a leaf
module with a single 1-D ``weight`` whose outputs equal, bit for bit in fp32 and bf16,
one of SGLang's norm variants (weight times the normalised input cast back to the input
dtype, cast after the product as OLMo2 does, or Gemma's ``1 + weight``) with one of the
module's own epsilon attributes. Checkpoint names do not change.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
from torch import nn

from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match
from sglang_hf_backend.surgery.trace import ModuleTrace


class _HFShapes:
    """Accept HF's ``[..., hidden]`` tensors; ``norm(x, residual)`` returns (normed, x + residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if residual is None:
            return super().forward(flat).view(shape)
        out, residual = super().forward(flat, residual.reshape(-1, shape[-1]))
        return out.view(shape), residual.view(shape)


class HFRMSNorm(_HFShapes, RMSNorm):
    pass


class HFGemmaRMSNorm(_HFShapes, GemmaRMSNorm):
    pass


@dataclasses.dataclass(frozen=True)
class NormVariant:
    label: str
    gemma: bool = False
    cast_before_weight: bool = True

    def build(self, size: int, eps: float, dtype: torch.dtype) -> nn.Module:
        if self.gemma:
            return HFGemmaRMSNorm(size, eps=eps).to(dtype)
        return HFRMSNorm(size, eps=eps, cast_x_before_out_mul=self.cast_before_weight, weight_dtype=dtype)


VARIANTS = (
    NormVariant("RMSNorm"),
    NormVariant("RMSNorm (cast after weight)", cast_before_weight=False),
    NormVariant("GemmaRMSNorm", gemma=True),
)


@dataclasses.dataclass(frozen=True)
class NormMatch(Match):
    variant: NormVariant
    eps_attribute: str


class RMSNormFuser(Fuser[NormMatch]):
    name = "norm"

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> NormMatch | None:
        params = dict(instance.named_parameters())
        if list(params) != ["weight"] or params["weight"].ndim != 1:
            return None
        if list(instance.children()) or list(instance.buffers()):
            return None
        for eps_attribute in _epsilon_attributes(instance):
            for variant in VARIANTS:
                if _behaves_like(instance, variant, getattr(instance, eps_attribute)):
                    description = f"{type(instance).__name__} -> SGLang {variant.label}"
                    return NormMatch(type(instance), description, None, variant, eps_attribute)
        return None

    def fuse(self, name: str, instance: nn.Module, match: NormMatch, quant_config) -> nn.Module:
        weight = instance.weight
        return match.variant.build(weight.shape[0], getattr(instance, match.eps_attribute), weight.dtype)


def _epsilon_attributes(instance: nn.Module) -> list[str]:
    return [k for k, v in vars(instance).items() if isinstance(v, float) and 0 < v < 1e-2]


def _behaves_like(instance: nn.Module, variant: NormVariant, eps: float) -> bool:
    """Same outputs as ``variant`` on random inputs, in fp32 and in bf16?"""
    size = instance.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(size, generator=generator) * 0.5 + (0.0 if variant.gemma else 1.0)
    x = torch.randn(3, 5, size, generator=generator) * 3
    for dtype in (torch.float32, torch.bfloat16):
        original = copy.deepcopy(instance).to_empty(device="cpu").to(dtype)
        original.weight.data.copy_(weight)
        candidate = variant.build(size, eps, dtype)
        candidate.weight.data.copy_(weight)
        try:
            with torch.no_grad():
                if not torch.equal(original(x.to(dtype)), candidate(x.to(dtype))):
                    return False
        except Exception:
            return False
    return True
