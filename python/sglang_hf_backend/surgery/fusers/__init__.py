"""Automatic layer fusion: one pattern per file, matched once per module class.

Each fuser looks at a module class's dataflow trace (``surgery/trace.py``) and, where its
pattern is there, returns a ``Match`` holding the rewritten forward; ``apply`` then swaps
the layers of every instance of that class and returns the checkpoint routes of the
layers it fused. Every fuser declares its own ``packed_modules_mapping`` (what SGLang's
quantization configs and LoRA see) so nothing about a pattern lives elsewhere.

Fusers run in order: norms (so residual fusion can use the fused-add form), then
q/k/v, gate/up, and residual+norm. ``SGLANG_HF_BACKEND_DISABLE_FUSIONS=qkv,mlp,norm,residual``
switches any of them off in every process.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Callable, ClassVar

from torch import nn

from sglang_hf_backend.surgery.fusers.rewrite import RewriteError
from sglang_hf_backend.surgery.linear import Placement
from sglang_hf_backend.surgery.tensor_parallel import TPLayout
from sglang_hf_backend.surgery.trace import ModelTrace, ModuleTrace
from sglang_hf_backend.weights import Route

DISABLE_ENV = "SGLANG_HF_BACKEND_DISABLE_FUSIONS"


@dataclasses.dataclass
class FusionContext:
    tp_size: int
    layout: TPLayout
    fused_norm_classes: set[type] = dataclasses.field(default_factory=set)

    def placement(self, instance: str, child: str) -> Placement:
        return self.layout.placements[f"{instance}.{child}" if instance else child]


@dataclasses.dataclass
class Match:
    """A pattern found in one module class, with everything needed to fuse its instances."""

    fuser: "Fuser"
    module_class: type
    detail: object
    forward: Callable | None  # the rewritten forward, bound to each instance
    description: str


class Fuser(abc.ABC):
    name: ClassVar[str]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    @abc.abstractmethod
    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> Match | None:
        """Look for the pattern in the class of ``instance``; raise RewriteError to explain a miss."""

    @abc.abstractmethod
    def apply(
        self, root: nn.Module, name: str, instance: nn.Module, match: Match, quant_config
    ) -> dict[str, Route]:
        """Fuse one instance (``name`` under ``root``); return checkpoint routes it needs."""

    def packed_names(self, match: Match) -> dict[str, list[str]]:
        """This model's own names behind each fused layer (for packed_modules_mapping)."""
        return {}


@dataclasses.dataclass
class FusionPlan:
    matches: list[Match]
    notes: list[str]  # patterns seen but left unfused, and why

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        mapping: dict[str, list[str]] = {}
        for match in self.matches:
            mapping.update(match.fuser.packed_names(match))
        return mapping

    def log_lines(self, hf_class_name: str) -> list[str]:
        lines = [f"Fused in {m.module_class.__name__}: {m.description}" for m in self.matches]
        lines += self.notes
        if not self.matches:
            lines.append(f"no fusion pattern recognised in {hf_class_name}; serving it unfused")
        return lines


def all_fusers() -> list[Fuser]:
    from sglang_hf_backend.surgery.fusers.gate_up import GateUpFuser
    from sglang_hf_backend.surgery.fusers.qkv import QKVFuser
    from sglang_hf_backend.surgery.fusers.residual_norm import ResidualNormFuser
    from sglang_hf_backend.surgery.fusers.rms_norm import RMSNormFuser

    return [RMSNormFuser(), QKVFuser(), GateUpFuser(), ResidualNormFuser()]


def disabled_fusions() -> set[str]:
    """Names in ``SGLANG_HF_BACKEND_DISABLE_FUSIONS``; unknown names are an error."""
    raw = os.environ.get(DISABLE_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    known = {fuser.name for fuser in all_fusers()}
    if names - known:
        raise ValueError(
            f"{DISABLE_ENV} names unknown fusions {sorted(names - known)}; valid names: {sorted(known)}"
        )
    return names


def declared_packed_modules() -> dict[str, list[str]]:
    """Every fuser's packed layers under their usual names (for the model class attribute)."""
    mapping: dict[str, list[str]] = {}
    for fuser in all_fusers():
        mapping.update(fuser.packed_modules_mapping)
    return mapping


def plan_fusions(trace: ModelTrace, ctx: FusionContext) -> FusionPlan:
    disabled = disabled_fusions()
    plan = FusionPlan([], [f"fusion switched off: {name}" for name in sorted(disabled)])
    for fuser in all_fusers():
        if fuser.name in disabled:
            continue
        for module_class, class_trace in trace.classes.items():
            instances = trace.class_instances.get(module_class)
            if not instances:
                continue
            try:
                found = fuser.match(class_trace, instances[0][1], ctx)
            except RewriteError as reason:
                plan.notes.append(f"not fused in {module_class.__name__} ({fuser.name}): {reason}")
                continue
            if found is not None:
                plan.matches.append(found)
    return plan


def apply_fusions(root: nn.Module, trace: ModelTrace, plan: FusionPlan, quant_config) -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for match in plan.matches:
        for name, instance in trace.class_instances[match.module_class]:
            routes.update(match.fuser.apply(root, name, instance, match, quant_config))
    return routes
