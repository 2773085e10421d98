"""Automatic layer fusion: one pattern per file, matched once per module class.

``plan_fusions`` runs every fuser (``base.Fuser``) over every traced module class, each
after the fusers it ``requires``; ``apply_fusions`` then fuses every instance of the
matched classes and collects the checkpoint routes their packings declare.
``SGLANG_HF_BACKEND_DISABLE_FUSIONS=qkv,mlp,norm,residual,moe`` switches fusers off in
every process; a fuser whose requirement is switched off is skipped with a note.
"""

from __future__ import annotations

import dataclasses
import os

from torch import nn

from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match
from sglang_hf_backend.surgery.fusers.rewrite import RewriteError
from sglang_hf_backend.surgery.trace import ModelTrace
from sglang_hf_backend.weights import Route

DISABLE_ENV = "SGLANG_HF_BACKEND_DISABLE_FUSIONS"


def all_fusers() -> list[Fuser]:
    """Every fuser, each after the ones it requires."""
    from sglang_hf_backend.surgery.fusers.gate_up import GateUpFuser
    from sglang_hf_backend.surgery.fusers.moe import MoEFuser
    from sglang_hf_backend.surgery.fusers.qkv import QKVFuser
    from sglang_hf_backend.surgery.fusers.residual_norm import ResidualNormFuser
    from sglang_hf_backend.surgery.fusers.rms_norm import RMSNormFuser

    return _in_dependency_order([QKVFuser(), GateUpFuser(), MoEFuser(), ResidualNormFuser(), RMSNormFuser()])


def _in_dependency_order(fusers: list[Fuser]) -> list[Fuser]:
    by_name = {fuser.name: fuser for fuser in fusers}
    ordered: list[Fuser] = []

    def visit(fuser: Fuser, path: tuple[str, ...]) -> None:
        if fuser in ordered:
            return
        if fuser.name in path:
            raise ValueError(f"fusers require each other in a cycle: {' -> '.join(path + (fuser.name,))}")
        for required in fuser.requires:
            visit(by_name[required], path + (fuser.name,))
        ordered.append(fuser)

    for fuser in fusers:
        visit(fuser, ())
    return ordered


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
    """Every fuser's usual packed layers (for the model class attribute SGLang reads early)."""
    mapping: dict[str, list[str]] = {}
    for fuser in all_fusers():
        for packing in fuser.usual_packings:
            mapping.update(packing.packed_modules())
    return mapping


@dataclasses.dataclass
class FusionPlan:
    matches: list[tuple[Fuser, Match]]
    notes: list[str]  # patterns seen but left unfused, and why

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        mapping: dict[str, list[str]] = {}
        for fuser, match in self.matches:
            for packing in fuser.packings(match):
                mapping.update(packing.packed_modules())
        return mapping

    def matches_of(self, fuser_name: str) -> list[Match]:
        return [match for fuser, match in self.matches if fuser.name == fuser_name]

    def log_lines(self, hf_class_name: str) -> list[str]:
        lines = [f"Fused in {m.module_class.__name__}: {m.description}" for _, m in self.matches]
        lines += self.notes
        if not self.matches:
            lines.append(f"no fusion pattern recognised in {hf_class_name}; serving it unfused")
        return lines


def plan_fusions(trace: ModelTrace, ctx: FusionContext) -> FusionPlan:
    disabled = disabled_fusions()
    plan = FusionPlan([], [f"fusion switched off: {name}" for name in sorted(disabled)])
    for fuser in all_fusers():
        if fuser.name in disabled:
            continue
        missing = [name for name in fuser.requires if name in disabled]
        if missing:
            plan.notes.append(f"fusion {fuser.name} skipped: it builds on {', '.join(missing)}")
            continue
        found = []
        for module_class, class_trace in trace.classes.items():
            instances = trace.class_instances.get(module_class)
            if not instances:
                continue
            try:
                match = fuser.match(class_trace, instances[0][1], ctx)
            except RewriteError as reason:
                plan.notes.append(f"not fused in {module_class.__name__} ({fuser.name}): {reason}")
                continue
            if match is not None:
                found.append(match)
        ctx.matches[fuser.name] = found
        plan.matches += [(fuser, match) for match in found]
    return plan


def apply_fusions(root: nn.Module, trace: ModelTrace, plan: FusionPlan, quant_config) -> dict[str, Route]:
    """Fuse every instance of each matched class; the checkpoint routes of the fused layers."""
    routes: dict[str, Route] = {}
    for fuser, match in plan.matches:
        for name, instance in trace.class_instances[match.module_class]:
            fused = fuser.fuse(name, instance, match, quant_config)
            if fused is not instance:
                root.set_submodule(name, fused)
            for packing in fuser.packings(match):
                routes.update(packing.routes(name, fused))
    return routes
